"""The gefen-in-backward entry: Gefen stepped during backward (gefen_core.step_in_backward)
trains the LM task exactly as Gefen stepped normally does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gefen_bench import optimizers as registry
from gefen_bench.presets import PRESETS
from gefen_bench.train_lm import run_lm_job


def test_in_backward_entry_is_declared_and_not_timed_by_the_step_command() -> None:
    declared = {n for n, spec in registry.REGISTRY.items() if spec.steps_in_backward}
    assert declared == {"gefen-in-backward"}
    assert registry.availability("gefen-in-backward") is None
    assert "no backward pass" in (
        registry.availability("gefen-in-backward", torch.device("cpu"), plain_step=True) or "")


def test_lm_training_in_backward_matches_normal_gefen_without_clipping() -> None:
    cfg = dataclasses.replace(PRESETS["tiny"].lm, grad_clip=0.0, steps=6, eval_every=3)
    results = {}
    for name in ("gefen", "gefen-in-backward"):
        job = {"optimizer": name, "lr": 3e-3, "config": dataclasses.asdict(cfg),
               "device": "cpu", "seed": 0, "data_seed": 1}
        results[name] = run_lm_job(job, lambda event: None)
    normal, fused = results["gefen"], results["gefen-in-backward"]
    assert fused["grad_clip"] == 0.0 and fused["steps"] == 6
    assert fused["train_loss"] == normal["train_loss"]
    assert fused["eval_loss"] == normal["eval_loss"]
    assert fused["final_eval_loss"] == normal["final_eval_loss"]
    assert fused["state"] == normal["state"]
    assert normal["train_loss"][-1] < normal["train_loss"][0]


def test_lm_training_in_backward_skips_global_clipping() -> None:
    cfg = dataclasses.replace(PRESETS["tiny"].lm, grad_clip=1.0, steps=2, eval_every=2)
    job = {"optimizer": "gefen-in-backward", "lr": 3e-3, "config": dataclasses.asdict(cfg),
           "device": "cpu", "seed": 0, "data_seed": 1}
    result = run_lm_job(job, lambda event: None)
    assert result["grad_clip"] == 0.0 and result["steps"] == 2


def test_entry_steps_during_backward_and_releases_gradients() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    named = list(model.named_parameters())
    (opt,) = registry.build("gefen-in-backward", named, lr=1e-2, weight_decay=0.0,
                            device=torch.device("cpu"), model=model)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        model(x).square().mean().backward()
        if step > 0:  # the first step is a full step, later ones happen in backward
            # but for the smallest parameter, which keeps its gradient for opt.step() (the
            # handle sees gradient clipping between backward and step through it)
            kept = min(model.parameters(), key=lambda p: p.numel())
            assert all((p.grad is None) == (p is not kept) for p in model.parameters())
            assert all(torch.equal(p, b) == (p is kept)
                       for p, b in zip(model.parameters(), before))
        opt.step()
        opt.zero_grad()
    assert opt._global_step == 3


def _lm_config(*argv: str) -> dict[str, object]:
    import argparse

    from gefen_bench import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", *argv])
    train._check_args(args)
    return train._task_config(PRESETS["tiny"], "lm", args)


@pytest.mark.parametrize(("argv", "key", "value"), [
    (["--grad-clip", "0"], "grad_clip", 0.0),
    (["--batch", "3"], "batch", 3),
    (["--checkpointing"], "checkpointing", True),
])
def test_train_lm_overrides_reach_the_lm_config(argv: list[str], key: str,
                                                 value: object) -> None:
    assert _lm_config(*argv)[key] == value
    assert _lm_config()[key] == getattr(PRESETS["tiny"].lm, key) != value


def test_train_refuses_a_zero_batch() -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--batch must be >= 1"):
        _lm_config("--batch", "0")


def test_lm_training_with_checkpointing_recomputes_the_same_gradients() -> None:
    # Recomputed activations are the saved ones on the CPU, so the runs agree to the bit, in
    # backward too.
    runs = {}
    for name, checkpointing in (("gefen", False), ("gefen", True), ("gefen-in-backward", True)):
        cfg = dataclasses.replace(PRESETS["tiny"].lm, grad_clip=0.0, steps=4, eval_every=2,
                                  checkpointing=checkpointing)
        job = {"optimizer": name, "lr": 3e-3, "config": dataclasses.asdict(cfg),
               "device": "cpu", "seed": 0, "data_seed": 1}
        runs[name, checkpointing] = run_lm_job(job, lambda event: None)
    plain, ckpt = runs["gefen", False], runs["gefen", True]
    assert ckpt["train_loss"] == plain["train_loss"]
    assert runs["gefen-in-backward", True]["train_loss"] == plain["train_loss"]
    assert ckpt["final_eval_loss"] == plain["final_eval_loss"]
