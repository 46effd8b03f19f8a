"""The build's source: a checkpoint read from a local dir, a hub id or a GGUF file (or made tiny
and random, for tests and ``hexforge demo --tiny``)."""
