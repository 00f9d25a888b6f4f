"""Every config key has a description, and ``python -m slime_hydra.config describe`` prints it."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from conftest import ROOT
from slime_hydra.config import schema
from slime_hydra.config.describe import describe, field_comments, schema_keys

SCHEMAS = [cls for _, cls in inspect.getmembers(schema, inspect.isclass)
           if dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__]


def test_every_schema_field_has_a_description():
    docs = field_comments(inspect.getsourcefile(schema))
    undescribed = [f"{cls.__name__}.{f.name}" for cls in SCHEMAS for f in dataclasses.fields(cls)
                   if not docs.get(cls.__name__, {}).get(f.name)]
    assert not undescribed, ("give these fields of slime_hydra/config/schema.py a trailing comment (the description "
                             f"`python -m slime_hydra.config describe` prints): {undescribed}")


def test_every_schema_is_reachable_from_the_root():
    """A dataclass of schema.py that RunConfig does not reach would have keys that describe never lists."""
    reached = {k.owner for k in schema_keys()}
    assert set(SCHEMAS) == reached, set(SCHEMAS) ^ reached


def test_comment_rules(tmp_path):
    """Trailing comment first; else the comment lines right above; a blank line or code above ends them."""
    src = tmp_path / "m.py"
    src.write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass C:\n"
        "    # a heading, then a blank line\n\n"
        "    a: int = 1  # the a\n"
        "    # first line of b\n    # second line of b\n    b: int = 2\n"
        "    c: int = 3\n"
        "    # heading of d\n    d: int = 4  # the d\n")
    assert field_comments(str(src)) == {"C": {"a": "the a", "b": "first line of b second line of b", "c": "",
                                              "d": "the d"}}


def test_describe_shows_type_value_and_description_under_overrides():
    out = describe(["rollout.batch_size", "rollout.engine"], ["rollout=sglang"]).splitlines()
    batch = next(line for line in out if line.startswith("rollout.batch_size "))
    assert "int = " in batch and "# prompts per rollout" in batch
    engine = next(line for line in out if line.startswith("rollout.engine "))
    assert "str = sglang" in engine


def test_describe_a_group_lists_nested_and_list_keys():
    out = describe(["eval"])
    assert "eval.datasets[].max_prompts" in out and "eval.datasets  " in out and "['heldout']" in out


def test_cli_prints_a_key_and_refuses_an_unknown_one():
    cmd = [sys.executable, "-m", "slime_hydra.config", "describe"]
    ok = subprocess.run(cmd + ["algo.eps_clip", "algo=dr_grpo"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "algo.eps_clip" in ok.stdout and "PPO ratio clip" in ok.stdout
    bad = subprocess.run(cmd + ["algo.eps"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean" in bad.stderr and "algo.eps_clip" in bad.stderr


@pytest.mark.parametrize("argv", [["--help"]])
def test_run_help_names_the_describe_command(argv):
    out = subprocess.run([sys.executable, "run.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m slime_hydra.config describe" in out.stdout and "rollout: " in out.stdout
