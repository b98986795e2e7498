"""Training: the typed config and its checks, data (synthetic passkey, token files, text), the job
builder, the step, checkpoints (DCP), resuming and the loop behind ``burstattn train``."""
from .checks import check_config, check_parallel, model_config
from .config import TrainConfig, config_from_mapping, load_config
from .data import FileData, PasskeyData, decode, encode, make_data
from .job import Job, build_job, local_batch
from .resume import ResumeError, Resumed, resume
from .step import StepResult, train_step

__all__ = ["check_config", "check_parallel", "model_config", "ResumeError", "Resumed", "resume", "TrainConfig", "config_from_mapping", "load_config", "PasskeyData", "FileData", "make_data", "encode",
           "decode", "Job", "build_job", "local_batch", "StepResult", "train_step"]
