"""``trainer.compile``: the torch backend's decoder layers under torch.compile train as the eager ones do
(slow: inductor compiles the layer's forward and backward on the CPU, minutes on this machine)."""

from __future__ import annotations

import pytest
from tiny_trainer import config, fake_rollout, rl_trainer, train


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones(tiny_ckpt):
    runs = []
    for compiled in (True, False):
        cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", "trainer.micro_batch_size=3",
                     f"trainer.compile={str(compiled).lower()}")
        rl, be = rl_trainer(cfg, tiny_ckpt)
        # two rollouts of different lengths: the second runs the same graph (dynamic sequence lengths)
        data = [fake_rollout(8, seed=0), fake_rollout(8, seed=1)]
        data[1]["tokens"] = [t + t[:3] for t in data[1]["tokens"]]
        metrics = [train(rl, cfg, d) for d in data]
        runs.append((metrics, {k: v.clone() for k, v in be.model.state_dict().items()}))
    (cm, cw), (em, ew) = runs
    for a, b in zip(cm, em):
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # Adam divides by the gradient's RMS: a rounding difference in a gradient near zero can move a weight by up to
    # the learning rate a step (the gradients are compared above, through grad_norm). So nearly every weight is within
    # 1% of the learning rate (on an AVX2 machine one of 2048 in a matrix was 1.04%), and every one within two steps
    lr = cfg.algo.lr
    for k in cw:
        diff = (cw[k] - ew[k]).abs()
        assert float((diff <= 1e-2 * lr + 1e-5 * ew[k].abs()).float().mean()) >= 0.999, k
        assert float(diff.max()) <= 2 * lr, k
