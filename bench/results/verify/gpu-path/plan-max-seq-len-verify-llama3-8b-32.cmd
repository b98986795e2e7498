nice -n 19 burstattn plan --max-seq-len --model llama3-8b --gpus 32 --cluster h100-nvlink-ib --mode train --verify 1 --json
