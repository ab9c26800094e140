#!/usr/bin/env python
"""Megatron checkpoint (any TP/PP) -> HF folder. See megatron_dppo/convert/tools.py (``--help``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dppo.convert.tools import megatron_to_hf_main

if __name__ == "__main__":
    sys.exit(megatron_to_hf_main())
