"""The forge: HF checkpoint -> bundle, stage by stage (source, export, quantize, compile, oracle,
genie; pipeline.py runs them in order). Build-time code (torch, transformers)."""
