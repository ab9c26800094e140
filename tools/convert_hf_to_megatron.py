#!/usr/bin/env python
"""HF folder -> Megatron dist checkpoint. See megatron_dppo/convert/tools.py (``--help``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dppo.convert.tools import hf_to_megatron_main

if __name__ == "__main__":
    sys.exit(hf_to_megatron_main())
