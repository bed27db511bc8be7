"""Other memory-RL recipes, each in its own files, built from the core's pieces (the engine, grpo.py,
sft.run_sft, train.update and the run, checkpoint.py). The core never imports them.

    python -m recipes.memtrain --model SFT_RUN/final     # MemTrain: self-supervised memory pre-training
    python -m recipes.memalpha                          # Mem-alpha: structured memory built by tool calls
"""
