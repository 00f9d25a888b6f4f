"""DataSource: seeded per-epoch order, group construction, buffer, exact resume; the config builders."""

import json

import pytest

from slime_hydra.config.schema import DataConfig, EvalDatasetConfig
from slime_hydra.data.dataset import Row
from slime_hydra.data.sample import Sample, Status
from slime_hydra.data.source import DataSource, build_data_source, load_eval_dataset
from slime_hydra.data.tokenizer import builtin_tokenizer


def make_source(n=7, k=3, shuffle=True, seed=11, **kw):
    rows = [Row(prompt=f"p{i}", label=str(i), metadata={"i": i}, tools=[{"name": "t"}] if i == 0 else None,
                source=f"d.jsonl:{i + 1}") for i in range(n)]
    return DataSource(rows, [f"P{i}" for i in range(n)], k, shuffle=shuffle, seed=seed, **kw)


def prompts_of(groups):
    return [g[0].prompt for g in groups]


def test_groups_indices_and_fields():
    src = make_source(shuffle=False)
    groups = src.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [g[0].group_index for g in groups] == [0, 1] and all(len({s.group_index for s in g}) == 1 for g in groups)
    s = groups[0][0]
    assert (s.prompt, s.label, s.status) == ("P0", "0", Status.PENDING)
    assert s.metadata == {"i": 0, "source": "d.jsonl:1", "tools": [{"name": "t"}]}
    assert "tools" not in groups[1][0].metadata
    groups[0][0].metadata["i"] = 99  # deep copies: siblings and the dataset are untouched
    assert groups[0][1].metadata["i"] == 0 and src.rows[0].metadata["i"] == 0


def test_epochs_are_seeded_permutations_and_wrap():
    src = make_source(n=5, k=1)
    first = prompts_of(src.get_samples(3)) + prompts_of(src.get_samples(3))  # crosses into epoch 1
    assert src.epoch == 1 and sorted(first[:5]) == [f"P{i}" for i in range(5)]
    again = make_source(n=5, k=1)
    assert prompts_of(again.get_samples(6)) == first  # same seed, same order
    other = make_source(n=5, k=1, seed=12)
    assert prompts_of(other.get_samples(5)) != first[:5]
    src2 = make_source(n=5, k=1)
    src2.get_samples(5)
    assert src2.epoch == 0  # an epoch ends only when the next prompt is needed
    e1 = prompts_of(src2.get_samples(5))
    assert src2.epoch == 1 and sorted(e1) == sorted(first[:5]) and e1 != first[:5]


def test_no_shuffle_is_file_order():
    assert prompts_of(make_source(n=3, k=1, shuffle=False).get_samples(4)) == ["P0", "P1", "P2", "P0"]


def test_buffer_served_first_fifo_and_checked():
    src = make_source(k=2)
    g = src.get_samples(3)
    src.add_samples([g[2], g[0]])
    out = src.get_samples(3)
    assert out[0] is g[2] and out[1] is g[0] and out[2][0].group_index == 3 and src.buffer == []
    with pytest.raises(ValueError, match="group 0 has 1 samples, expected n_samples_per_prompt=2"):
        src.add_samples([g[1][:1]])
    with pytest.raises(ValueError, match="group 0 must be a list of Sample"):
        src.add_samples([["x", "y"]])


def test_custom_buffer_filter():
    def newest_first(buffer, n):
        taken = buffer[-n:][::-1]
        del buffer[-n:]
        return taken

    src = make_source(k=1, buffer_filter=newest_first)
    g = src.get_samples(3)
    src.add_samples(g)
    assert [x[0].group_index for x in src.get_samples(2)] == [2, 1]
    bad = make_source(k=1, buffer_filter=lambda buf, n: list(buf))  # does not pop
    bad.add_samples(bad.get_samples(1))
    with pytest.raises(ValueError, match="must remove the groups"):
        bad.get_samples(1)


def test_resume_is_exact():
    k_batches, batch = 4, 3
    ref = make_source()
    expected = [[(s.prompt, s.index, s.group_index) for g in ref.get_samples(batch) for s in g] for _ in range(10)]

    run = make_source()
    got = [[(s.prompt, s.index, s.group_index) for g in run.get_samples(batch) for s in g] for _ in range(k_batches)]
    state = json.loads(json.dumps(run.state_dict()))  # JSON-serialisable
    resumed = make_source()
    resumed.load_state_dict(state)
    got += [[(s.prompt, s.index, s.group_index) for g in resumed.get_samples(batch) for s in g]
            for _ in range(10 - k_batches)]
    assert got == expected


def test_resume_keeps_the_buffer():
    src = make_source(k=2)
    g = src.get_samples(2)
    g[0][0].response, g[0][0].status, g[0][0].reward = "partial", Status.ABORTED, {"acc": 1.0}
    src.add_samples([g[0]])
    state = json.loads(json.dumps(src.state_dict()))
    new = make_source(k=2)
    new.load_state_dict(state)
    out = new.get_samples(2)
    assert isinstance(out[0][0], Sample) and out[0][0].to_dict() == g[0][0].to_dict()
    assert out[0][0].status is Status.ABORTED and out[1][0].group_index == 2


def test_resume_refuses_another_dataset():
    state = make_source(n=7).state_dict()
    with pytest.raises(ValueError, match="num_prompts saved 7, now 8"):
        make_source(n=8).load_state_dict(state)


def test_constructor_checks():
    with pytest.raises(ValueError, match="empty"):
        DataSource([], [], 1, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="2 rows but 1 prompts"):
        DataSource(make_source(n=2).rows, ["x"], 1, shuffle=False, seed=0)


# ------------------------------------------------------------------------------------ builders
def test_build_from_builtin_task():
    cfg = DataConfig(name="digits", source="builtin", num_train=20, num_eval=5, seed=3)
    tok = builtin_tokenizer("builtin:digits")
    src = build_data_source(cfg, tok, n_samples_per_prompt=2)
    assert len(src) == 20
    s = src.get_samples(1)[0][0]
    assert s.prompt.endswith("=") and s.label == max(s.prompt[:-1])
    rows, prompts = load_eval_dataset(EvalDatasetConfig(name="held", reward="exact", max_prompts=3), cfg, tok)
    assert len(prompts) == 3 and rows[0].metadata == {"rm_type": "exact"}
    assert not set(prompts) & {p for p in src.prompts}  # held-out prompts are disjoint


def test_build_from_file_with_template_and_length_filter(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": p, "a": "1", "metadata": {"rm_type": "math"}}) + "\n"
                            for p in ["12", "1234567", "3"]))
    cfg = DataConfig(name="f", source="jsonl", path=str(path), input_key="q", label_key="a",
                     apply_chat_template=True, system_prompt="0", shuffle=False)
    tok = builtin_tokenizer("builtin:digits")
    src = build_data_source(cfg, tok, n_samples_per_prompt=1, max_prompt_len=4)
    assert src.prompts == ["0|12", "0|3"] and [r.source[-1] for r in src.rows] == ["1", "3"]
    ecfg = EvalDatasetConfig(name="e", path=f"{path}@[1:]", input_key="q", label_key="a", reward="exact")
    rows, prompts = load_eval_dataset(ecfg, cfg, tok)
    assert prompts == ["0|1234567", "0|3"] and rows[0].metadata["rm_type"] == "math"  # the row's own rm_type wins
