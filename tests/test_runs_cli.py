"""``python -m slime_hydra.runs``: run directories as a run leaves them (a resolved config.yaml, .hydra/,
metrics.jsonl, summary.json) listed and compared, as plain text in a pipe and as a rich table on a terminal."""

from __future__ import annotations

import io
import json

from omegaconf import OmegaConf

from conftest import resolved


def make_run(d, overrides, rewards, summary=True):
    from slime_hydra.logging.secrets import redacted_config

    (d / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), d / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create(redacted_config(resolved(overrides))), d / "config.yaml")
    rows = [{"step": s, "rollout/reward_mean": r / 2, "eval/heldout/reward": r} for s, r in enumerate(rewards, 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (d / "summary.json").write_text(json.dumps({"eval_reward_final": rewards[-1], "wall_s": 12.5}))
    return d


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_list_shows_status_rewards_and_only_the_overrides_that_differ(tmp_path, capsys):
    from slime_hydra import runs

    make_run(tmp_path / "a", ["algo.lr=0.003", "algo=grpo", "seed=7"], [0.1, 0.5, 0.4])
    make_run(tmp_path / "b", ["algo=dr_grpo", "trainer.num_rollout=3", "hydra.run.dir=x"], [0.2], summary=False)
    assert runs.main(["list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["# runs", "\t".join(runs.LIST_COLUMNS)]
    a, b = (line.split("\t") for line in lines[2:])
    assert a[2:7] == ["ok", "3", "0.400", "0.500", "seed=7"]  # algo.lr=0.003 and algo=grpo are the defaults
    assert b[2:7] == ["incomplete", "1", "0.200", "0.200", "algo=dr_grpo trainer.num_rollout=3"]


def test_compare_diffs_configs_tabulates_metrics_and_draws_curves(tmp_path, capsys):
    from slime_hydra import runs

    a = make_run(tmp_path / "a", ["algo.lr=0.003"], [0.1, 0.5])
    b = make_run(tmp_path / "b", ["algo.lr=0.005", "seed=3"], [0.2, 0.3])
    png = tmp_path / "cmp.png"
    assert runs.main(["compare", str(a), str(b), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "algo.lr\t0.003\t0.005" in out and "seed\t1234\t3" in out
    assert "run_name" not in out  # the same in both
    assert "best eval\t0.500\t0.300" in out and "wall_s\t12.500\t12.500" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert runs.main(["compare", str(a)]) == 2

    term = Terminal()
    runs.show("config", ["key", "a", "b"], runs.config_diff([str(a), str(b)]), out=term)
    assert term.getvalue().count("┃") >= 4 and "│ algo.lr " in term.getvalue()  # a rich table
