"""Multi-process conversion (gloo): HF logits == Megatron logits at TP2 / PP2 / TP2xPP2 / VPP, the streaming
export gathered over TP/PP is bit-exact on every rank, and checkpoints written at TP/PP>1 reshard back to HF."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from _hf_models import ODD_SHAPES, TINY, hf_logits, save_hf_model, tokens

from megatron_dppo.convert.hf_io import HFCheckpoint

pytestmark = pytest.mark.multiproc
LOGITS_ATOL = 2e-5


def _worker(hf_dir: str, tp: int, pp: int, vpp: int | None, out_dir: str | None, bucket_bytes: int):
    """Every rank: load the HF weights into its shard, run the pipeline, export; optionally save a checkpoint."""
    from _hf_models import megatron_logits
    from megatron.core import parallel_state as ps

    from megatron_dppo.convert import export_hf_weights, load_hf_weights
    from megatron_dppo.convert.checkpoint import arch_from_hf_config, convert_hf_to_megatron
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    source = HFCheckpoint(hf_dir)
    arch = arch_from_hf_config(source.config)
    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp)
    initialize_parallel(parallel, seed=7, arch=arch)
    chunks = build_model_chunks(arch, parallel, torch.float32)
    load_hf_weights(chunks, arch, source.get)
    logits = megatron_logits(chunks, tokens()) if vpp is None else None
    exported = dict(export_hf_weights(chunks, arch, bucket_bytes=bucket_bytes))
    if out_dir is not None:
        convert_hf_to_megatron(hf_dir, out_dir, tp=tp, pp=pp)
    return {"logits": logits, "exported": exported, "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


def _check(name: str, tmp_path: Path, tp: int, pp: int, vpp: int | None = None, save: bool = False,
           bucket_bytes: int = 32 * 1024, timeout: float = 240) -> None:
    src = save_hf_model(name, tmp_path / "hf")
    out = tmp_path / "meg" if save else None
    results = run_distributed(_worker, world_size=tp * pp,
                              args=(str(src), tp, pp, vpp, str(out) if out else None, bucket_bytes),
                              timeout=timeout)
    source = HFCheckpoint(src)
    state = {n: source.get(n) for n in source.shapes}
    if vpp is None:
        expected = hf_logits(src, tokens())
        last = [r for r in results if r["pp_rank"] == pp - 1]
        assert len(last) == tp
        diff = max((r["logits"] - expected).abs().max().item() for r in last)
        print(f"\n{name} tp={tp} pp={pp}: max |logit diff| vs transformers = {diff:.2e}")
        assert diff < LOGITS_ATOL  # every TP rank of the last stage holds the full (gathered) logits
    for r in results:  # every rank yields the same, complete, bit-exact stream
        assert set(r["exported"]) == set(state)
        assert all(torch.equal(r["exported"][n], state[n]) for n in state)
    if save:
        from _dist import single_process_world

        from megatron_dppo.convert.checkpoint import convert_megatron_to_hf

        with single_process_world():  # written at tp x pp, read back at TP1/PP1 (resharding)
            back = convert_megatron_to_hf(out, tmp_path / "back")
        again = HFCheckpoint(back)
        assert set(again.shapes) == set(state)
        assert all(torch.equal(again.get(n), state[n]) for n in state)


def test_tp2_logits_export_and_reshard_qwen2(tmp_path):
    """TP2 (GQA, q/k/v bias, untied): logits, the TP-gathered export, and a TP2 checkpoint read at TP1."""
    _check("qwen2_untied", tmp_path, tp=2, pp=1, save=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ODD_SHAPES))
def test_tp2_one_kv_head_and_odd_vocabulary(name, tmp_path):
    """One KV head at TP2 and a 127-row vocabulary (padded to 128 at TP2): logits equal transformers', the
    TP-gathered export is bit-exact (padding dropped), and the TP2 checkpoint reads back at TP1 (127 rows)."""
    _check(name, tmp_path, tp=2, pp=1, save=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(TINY) - {"qwen2_untied"}))
def test_tp2_other_families(name, tmp_path):
    _check(name, tmp_path, tp=2, pp=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_pp2_logits_and_export(name, tmp_path):
    """PP2: tied embeddings live on both stages (the last stage's copy is filled on import, skipped on export)."""
    _check(name, tmp_path, tp=1, pp=2, save=name == "llama_tied")


@pytest.mark.slow
def test_tp2_pp2_qwen3_tied(tmp_path):
    _check("qwen3_tied", tmp_path, tp=2, pp=2, save=True, timeout=420)


@pytest.mark.slow
def test_virtual_pipeline_export(tmp_path):
    """PP2 x VPP2: layer indices made global per chunk (stage 0 holds layers 0 and 2)."""
    _check("llama_untied", tmp_path, tp=1, pp=2, vpp=2, save=True)


@pytest.mark.slow
def test_torchrun_conversion_error_is_printed_once_and_every_rank_exits_2(tmp_path):
    """A truncated safetensors file under torchrun (TP2): one `error:` line (rank 0's), and rank 0 exits with
    status 2 first (the other ranks wait a few seconds, so torchrun, which stops every worker once one exits,
    cannot kill rank 0 before it reports); torchrun itself then exits 1, as for any failed worker."""
    import re
    import socket
    import subprocess
    import sys

    src = save_hf_model("llama_tied", tmp_path / "hf")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={port}",
                           str(repo / "tools" / "convert_hf_to_megatron.py"), str(src), str(tmp_path / "out"),
                           "--tp", "2"], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert "model.safetensors" in errors[0] and "truncated or corrupt" in errors[0]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", output)
    assert codes and set(codes) <= {"2", "-15"}, output[-3000:]
    assert re.search(r"Root Cause.*?rank\s*:\s*0 .*?exitcode\s*:\s*2\b", output, re.S), output[-3000:]
    assert "SafetensorError" not in output and str(repo / "megatron_dppo") not in output  # no worker traceback
    assert not (tmp_path / "out").exists()
