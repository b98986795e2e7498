"""Training: the typed config, data (synthetic passkey, token files, text), the job builder,
the step, checkpoints (DCP) and the loop behind ``burstattn train``."""
from .config import TrainConfig, config_from_mapping, load_config
from .data import FileData, PasskeyData, decode, encode, make_data
from .job import Job, build_job, local_batch
from .step import StepResult, train_step

__all__ = ["TrainConfig", "config_from_mapping", "load_config", "PasskeyData", "FileData", "make_data", "encode",
           "decode", "Job", "build_job", "local_batch", "StepResult", "train_step"]
