"""Two-GPU tests (``multigpu``): the CPU-tested distributed workers, run on two CUDA ranks.

Each test spawns the same module-level worker that a CPU (gloo) test in this directory runs,
with ``device="cuda"`` (one GPU per rank, ``torch.cuda.set_device(rank)``) and the
``"cpu:gloo,cuda:nccl"`` process group that test_dist_gpu.py uses at world size 1, so CUDA
collectives go through NCCL. The workers and most assertions are shared with those tests; what
differs on CUDA is documented in each worker (``deterministic=True`` wherever a result is
compared bit for bit, because the fused CUDA kernels use float atomics otherwise,
docs/algorithm.md#deterministic).

Bit-exact comparisons against a single-GPU run stay exact on NCCL for the same reason as on
gloo: every rank feeds the same batch, so FSDP2's averaged reduce-scatter ((g + g) / 2) returns
exactly the single-process gradient whatever the reduction order. DDP and DeepSpeed feed
different data per rank and assert that the replicas agree with each other.

Skipped only when fewer than two CUDA GPUs are visible; scripts/run_gpu_tests.sh runs them
(marker ``multigpu``) and counts a skip as a failure. NVLink multicast stays off in the spawned
ranks (the lent machines' notes say why), whether or not the caller exported it.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from test_deepspeed import EXT_DIR, GPU_CASES, RESUME, SPLIT, STEPS, _zero_worker
from test_dist_dcp import _check_exact, _check_reblocked, _gap_of_codebook, _scenario
from test_dist_ddp import _ddp_worker
from test_dist_gpu import _gpu_worker
from test_dist_muon_sharded import _modes_worker, check_modes
from test_dist_native import _native_worker, check_native

from gefen_dist.testing import run_distributed

BACKEND = "cpu:gloo,cuda:nccl"
NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture(autouse=True)
def _no_nvlink_multicast(monkeypatch):
    # Also in the parent's environment, so the spawned interpreters start with it (``env=``
    # is applied only once the child runs the worker, after its imports).
    for key, value in NO_NVLS.items():
        monkeypatch.setenv(key, value)


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(420)
def test_multigpu_ddp_nccl_replicas_stay_bit_identical():
    """test_dist_ddp's worker on two GPUs: DDP over NCCL, different data per rank; every
    parameter, state tensor, step count and the codebook agree across ranks bit for bit."""
    out = run_distributed(_ddp_worker, 2, "cuda", backend=BACKEND, timeout=360,
                          collective_timeout=180, env=NO_NVLS)
    for r in out:
        assert r["differs"] == [], f"tensors differing across ranks: {r['differs']}"
        assert r["codes"] > 0 and r["n"] > 20
    assert out[0]["losses"] != out[1]["losses"]


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(660)
def test_multigpu_fsdp2_sharded_gefen_matches_single_gpu_and_dcp_resumes(tmp_path):
    """test_dist_gpu's FSDP2 worker (per-block second moment, fused kernels) on two GPUs:
    ShardedGefen on the sharded TinyLM ends bit-identical to a single-GPU Gefen with the same
    (shard-aligned) periods, and GefenDCPState sync and async checkpoints continue
    bit-identically on two ranks. (The factored second moment all-reduces partial row/column
    sums, which is within bounds but not bitwise on more than one rank; test_dist_fsdp checks
    it on gloo.)"""
    results = run_distributed(_gpu_worker, 2, str(tmp_path), False, backend=BACKEND,
                              timeout=600, collective_timeout=300, env=NO_NVLS)
    for rank, r in enumerate(results):
        assert r["paths"] == ["fused"], (rank, r["paths"])
        assert r["matches_single_process"], rank
        assert r["sync_resume_exact"] and r["async_resume_exact"], (rank, r)


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(660)
def test_multigpu_native_checkpoints_full_and_sharded(tmp_path):
    """test_dist_native's worker on two GPUs: a full (``full_state_dict=True``) optimizer
    state dict restores a fresh ShardedGefen exactly and continues bit-identically; a sharded
    round trip restores exactly; a checkpoint rejected on one rank raises on both and changes
    nothing; sharded DCP files load exactly or fail loudly."""
    results = run_distributed(_native_worker, 2, str(tmp_path), "cuda", backend=BACKEND,
                              timeout=600, collective_timeout=300, env=NO_NVLS)
    check_native(results)


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(900)
def test_multigpu_dcp_reshard_2_to_1_and_1_to_2(tmp_path):
    """test_dist_dcp's scenario on GPUs: GefenDCPState saved on two GPUs resumes on one, and
    saved on one resumes on two. The block-aligned model continues bit-identically and the
    uninterrupted one- and two-GPU runs agree; the small model's re-blocked state matches the
    reference built in test_dist_dcp from the saved dense state."""
    tmp = str(tmp_path)
    kws = ("aligned", "small")
    common = dict(backend=BACKEND, timeout=280, collective_timeout=120, env=NO_NVLS)
    s2 = run_distributed(_scenario, 2, tmp, [("train_save", "w2", k) for k in kws], "cuda",
                         **common)[0]
    s1 = run_distributed(_scenario, 1, tmp, [("resume", "w2", k) for k in kws]
                         + [("train_save", "w1", k) for k in kws], "cuda", **common)[0]
    s2b = run_distributed(_scenario, 2, tmp, [("resume", "w1", k) for k in kws], "cuda",
                          **common)[0]
    runs = {**s2, **s1, **s2b}
    moves = (("w2", "w2-on1"), ("w1", "w1-on2"))
    for src, dst in moves:
        _check_exact(runs[(src, "aligned")], runs[(dst, "aligned")])
    for name, t in runs[("w2", "aligned")]["final"].items():
        assert torch.equal(t, runs[("w1", "aligned")]["final"][name]), name
    # The planner expanded one parameter at a time: never more than the largest local shard.
    biggest = max(math.prod(t.shape) for t in runs[("w2", "aligned")]["final"].values())
    assert 0 < runs[("w2", "aligned")]["max_dense_bytes"] <= 4 * biggest
    for src, dst in moves:
        errs = _check_reblocked(runs[(src, "small")], runs[(dst, "small")],
                                _gap_of_codebook(tmp, src))
        print(f"{src} -> {dst} on GPUs: {len(errs)} re-blocked parameters")


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(660)
def test_multigpu_sharded_muon_modes_match_single_gpu():
    """test_dist_muon_sharded's worker on two GPUs: ShardedGefenMuon in "exact" and
    "distributed" mode equals the single-GPU GefenMuon bit for bit (parameters, losses,
    codebook, momentum codes, NorMuon statistics; complete state dict; resume), with an uneven
    and an empty shard; "approx" runs, stays finite, resumes, and differs (row blocks).

    Bitwise, not within a bf16 tolerance: both ranks feed the same batch, so the gradients the
    all-gather assembles equal the single-GPU gradients exactly whatever NCCL's reduction
    order, and Newton-Schulz then runs the same kernels on the same inputs on the same GPU
    model (``deterministic=True`` fixes the remaining reduction orders)."""
    results = run_distributed(_modes_worker, 2, "cuda", backend=BACKEND, timeout=600,
                              collective_timeout=300, env=NO_NVLS)
    check_modes(results)


def _zero_worker_on_gpu(rank: int, world: int, tmp: str) -> dict:
    """DeepSpeed picks its device from ``LOCAL_RANK``, which differs per rank (``env=`` is the
    same for every rank), so it is set here before ``deepspeed.initialize``."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    return _zero_worker(rank, world, tmp, GPU_CASES, True)


@pytest.mark.multigpu
@two_gpus
@pytest.mark.timeout(900)
def test_multigpu_deepspeed_zero2_3_two_ranks_bf16():
    """test_deepspeed's worker on two GPUs (bf16, NCCL), ZeRO-2/3 with and without CPU offload,
    different data per rank: Gefen steps its flat partitions, the held-out loss falls, the
    offloaded run follows the one without offload within bf16 forward rounding, save/load
    continues bit-identically, and the two ranks' weights agree bit for bit."""
    env = {**NO_NVLS, "TORCH_EXTENSIONS_DIR": EXT_DIR, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29534"}
    os.makedirs(EXT_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_distributed(_zero_worker_on_gpu, 2, tmp, backend="nccl", timeout=840,
                              collective_timeout=600, env=env)
    for case in GPU_CASES:
        for rank, r in enumerate(res):
            print(f"{case:40s} {rank:4d} " + " ".join(f"{v:.6f}" for v in r[case]["losses"]))
    for r in res:
        for case in GPU_CASES:
            c = r[case]
            assert c["global_step"] == STEPS and c["state_entries"] > 0 and c["flat"], case
            assert c["eval"][1] < c["eval"][0], f"{case}: held-out loss did not decrease"
        for base, off in (("stage2", "stage2+offload_optimizer"),
                          ("stage3", "stage3+offload_optimizer+offload_param")):
            torch.testing.assert_close(r[off]["losses"], r[base]["losses"], rtol=2e-3, atol=0)
        for case in set(RESUME) & set(GPU_CASES):
            c = r[case]
            assert c["resumed_losses"] == c["losses"][SPLIT:], f"{case}: resume diverged"
            assert c["resumed_step"] == STEPS
            for a, b in zip(c["resumed_params"], c["params"], strict=True):
                assert torch.equal(a, b), f"{case}: resumed weights differ"
    for case in GPU_CASES:
        for a, b in zip(res[0][case]["params"], res[1][case]["params"], strict=True):
            assert torch.equal(a, b), f"{case}: ranks disagree"
    # Different data per rank: equal replicas are the all-reduce's doing, not an accident.
    assert res[0]["stage2"]["losses"] != res[1]["stage2"]["losses"]
