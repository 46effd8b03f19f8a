"""The forge: HF checkpoint dir -> bundle. Build-time code (torch, transformers)."""
