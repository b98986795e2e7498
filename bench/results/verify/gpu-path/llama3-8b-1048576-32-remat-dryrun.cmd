burstattn train --dry-run --model llama3-8b --seq-len 1048576 --batch 1 --world-size 32 --dtype bfloat16 --checkpointing remat --mlp-chunk 4096 --loss-chunk 256 --fsdp --json
