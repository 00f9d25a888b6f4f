"""The embedded engine speaks SGLang's HTTP protocol: generation, control, weight updates, memory."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_hydra.sync.sender import Endpoint, WeightSender, WeightSyncError, save_config_and_tokenizer
from slime_hydra.train.batch import make_micro_batch, response_log_probs
from slime_hydra.utils.http import EngineError, control, weight_version

PROMPT = [5, 12, 3, 9, 4, 12]  # token ids of the builtin:digits vocabulary


def gen(url, payload):
    r = httpx.post(url + "/generate", json=payload, timeout=60)
    return r.status_code, r.json()


def recompute(model, prompt, out_ids, temperature=1.0):
    data = {"tokens": [prompt + out_ids], "response_lengths": [len(out_ids)], "loss_masks": [None]}
    mb = make_micro_batch(data, [0], len(out_ids))
    with torch.no_grad():
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos).logits
    return response_log_probs(logits, mb, temperature)[0][0].tolist()


def test_generate_single_and_batch(engine_url):
    code, out = gen(engine_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 1.0},
                                 "return_logprob": True})
    assert code == 200 and isinstance(out, dict)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"] <= 5
    assert [p[1] for p in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(p[0] <= 0 for p in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] == len(PROMPT)
    code, outs = gen(engine_url, {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 3}})
    assert code == 200 and isinstance(outs, list) and len(outs) == 2
    # SGLang's batched form with a field per prompt: the answers in prompt order, each under its rid
    params = [{"max_new_tokens": 2}, {"max_new_tokens": 4, "ignore_eos": True}]
    code, outs = gen(engine_url, {"input_ids": [PROMPT, PROMPT[:3]], "rid": ["p0", "p1"],
                                  "return_logprob": [False, True], "sampling_params": params})
    assert code == 200 and [o["meta_info"]["id"] for o in outs] == ["p0", "p1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(PROMPT), 3] and len(outs[1]["output_ids"]) == 4
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    assert len(outs[1]["meta_info"]["output_token_logprobs"]) == 4
    code, outs = gen(engine_url, {"text": "123=", "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert code == 200 and len(outs) == 3


def test_greedy_is_deterministic_and_length_finish(engine_url):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    a, b = gen(engine_url, body)[1], gen(engine_url, body)[1]
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 6
    assert a["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_stop_token_and_zero_tokens(engine_url):
    greedy = gen(engine_url, {"input_ids": PROMPT,
                              "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})[1]
    first = greedy["output_ids"][0]
    out = gen(engine_url, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first], "no_stop_trim": True}})[1]
    assert out["output_ids"] == [first] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    out = gen(engine_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})[1]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs_match_trainer_recompute(engine_url, tiny_ckpt):
    """The engine's log-probs of sampled tokens equal a fresh forward pass (fp32, temperature 1 and 0.7)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for temperature in (1.0, 0.7):
        outs = gen(engine_url, {"input_ids": [PROMPT] * 8, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 8, "temperature": temperature,
                                                    "ignore_eos": True}})[1]
        for out in outs:
            engine = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
            mine = recompute(model, PROMPT, out["output_ids"], temperature)
            assert max(abs(a - b) for a, b in zip(engine, mine)) < 1e-4


def test_bad_requests_are_400(engine_url):
    assert gen(engine_url, {"sampling_params": {}})[0] == 400  # neither text nor input_ids
    assert gen(engine_url, {"input_ids": [10**6]})[0] == 400  # out of vocabulary
    assert gen(engine_url, {"input_ids": PROMPT, "sampling_params": {"top_p": 2.0}})[0] == 400
    code, body = gen(engine_url, {"input_ids": []})
    assert code == 400 and "error" in body
    r = httpx.post(engine_url + "/generate", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    # a batch whose per-prompt lists do not match its prompts: the field is named
    batch = {"input_ids": [PROMPT, PROMPT], "sampling_params": [{}, {}], "rid": ["a", "b"]}
    for field, value, message in [
        ("sampling_params", [{}], "sampling_params has 1 entries for 2 prompt(s)"),
        ("sampling_params", [{}, {}, {}], "sampling_params has 3 entries for 2 prompt(s)"),
        ("rid", ["a"], "rid has 1 entries for 2 prompt(s)"),
        ("return_logprob", [True, True, True], "return_logprob has 3 entries for 2 prompt(s)"),
        ("rid", ["a", "a"], "Duplicate request IDs detected within the request: ['a']"),
        ("sampling_params", [{"n": 1}, {"n": 2}], "parallel_sample_num should be the same"),
        ("sampling_params", [{}, 3], "sampling_params must be an object"),
    ]:
        code, body = gen(engine_url, {**batch, field: value})
        assert code == 400 and message in body["error"]["message"], (field, value, body)


def test_info_endpoints(engine_url, tiny_ckpt):
    info = httpx.get(engine_url + "/server_info").json()
    assert info["model_path"] == tiny_ckpt and info["tp_size"] == 1 and "weight_version" in info
    assert httpx.get(engine_url + "/get_server_info").json()["model_path"] == tiny_ckpt
    assert httpx.get(engine_url + "/model_info").json()["is_generation"] is True
    loads = httpx.get(engine_url + "/v1/loads").json()["loads"]
    assert loads[0]["num_running_reqs"] == 0
    assert httpx.get(engine_url + "/health").status_code == 200
    assert httpx.get(engine_url + "/health_generate").status_code == 200
    assert httpx.get(engine_url + "/flush_cache").status_code == 200


def test_pause_then_abort_all(engine_url):
    """Requests queued while paused, then abort_all: every one finishes with reason abort."""
    control(engine_url, "/pause_generation", {"mode": "in_place"})
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(gen, engine_url, body) for _ in range(4)]
        time.sleep(0.5)
        assert all(not f.done() for f in futs)  # paused: nothing runs
        control(engine_url, "/abort_request", {"abort_all": True})
        control(engine_url, "/continue_generation", {})
        outs = [f.result() for f in futs]
    assert all(code == 200 and o["meta_info"]["finish_reason"]["type"] == "abort" for code, o in outs)
    after = gen(engine_url, body)[1]  # later requests are not aborted
    assert after["meta_info"]["finish_reason"]["type"] == "length"


def _running(url: str, n: int, timeout: float = 30.0) -> None:
    """Wait until the engine decodes ``n`` requests."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/v1/loads").json()["loads"][0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, f"{n} requests were not running within {timeout}s"
        time.sleep(0.01)


@pytest.mark.parametrize("abort", [{"rid": "b-1"}, {"abort_all": True}], ids=["one rid", "all"])
def test_abort_inside_a_batched_request(engine_url, abort):
    """A batched request's prompts have their own rids: /abort_request of one cuts that prompt's
    sample off and the others run to the end; abort_all cuts every one off. Each answer keeps the
    tokens made before the abort."""
    budget = 3000
    body = {"input_ids": [PROMPT] * 3, "rid": ["b-0", "b-1", "b-2"], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": budget, "ignore_eos": True, "sampling_seed": i} for i in range(3)]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(gen, engine_url, body)
        _running(engine_url, 3)
        time.sleep(0.2)  # a few tokens in
        control(engine_url, "/abort_request", abort)
        code, outs = answer.result()
    assert code == 200 and [o["meta_info"]["id"] for o in outs] == ["b-0", "b-1", "b-2"]
    aborted = [o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs]
    assert aborted == ([False, True, False] if "rid" in abort else [True] * 3)
    for out, cut in zip(outs, aborted):
        assert (0 < len(out["output_ids"]) < budget) if cut else len(out["output_ids"]) == budget
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def _scaled_weights(tiny_ckpt, factor):
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model


@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk", "disk_hub_id"])
def test_weight_push_changes_the_policy(engine_url, tiny_ckpt, tmp_path, transport):
    """A push over each transport lands: new version, and log-probs equal the pushed model's.
    ``disk_hub_id``: the model path is a hub id, whose config and tokenizer the disk transport saves
    with save_pretrained (a local checkpoint stands in for the id: there is no hub access here)."""
    if transport == "tensor":
        torch.multiprocessing.set_sharing_strategy("file_system")
    model_path = tiny_ckpt
    if transport == "disk_hub_id":
        transport, model_path = "disk", str(tmp_path / "hub_files")
        save_config_and_tokenizer(tiny_ckpt, model_path)  # what write_model_files does for a hub id
        assert not any(f.endswith(".safetensors") for f in os.listdir(model_path))
    model = _scaled_weights(tiny_ckpt, 1.5)
    sender = WeightSender(transport, [Endpoint(engine_url, 1)], torch.device("cpu"), bucket_mb=1,
                          disk_dir=str(tmp_path), model_path=model_path)
    sender.connect()
    try:
        stats = sender.push(list(model.state_dict().items()), version=7)
        assert stats["bytes"] > 0 and weight_version(engine_url) == "7"
        out = gen(engine_url, {"input_ids": PROMPT, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})[1]
        engine = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        mine = recompute(model, PROMPT, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(engine, mine)) < 1e-4
        # restore the original weights for the other tests
        original = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
        sender.push(list(original.state_dict().items()), version=0)
    finally:
        sender.close()
    if transport == "disk":
        assert [d for d in os.listdir(tmp_path) if d.startswith("weights_v")] == ["weights_v000000"]
        pushed = AutoTokenizer.from_pretrained(str(tmp_path / "weights_v000000"))  # a complete checkpoint
        assert pushed("3815=").input_ids == AutoTokenizer.from_pretrained(tiny_ckpt)("3815=").input_ids


def test_failed_push_raises_and_generation_continues(engine_url, tiny_ckpt, tmp_path):
    """The push paused generation; it continues after a failed push too (or every later request would wait)."""
    sender = WeightSender("tensor", [Endpoint(engine_url, 1)], torch.device("cpu"), 1, str(tmp_path), tiny_ckpt)
    with pytest.raises(WeightSyncError, match="no_such.weight|unknown parameter"):
        sender.push([("no_such.weight", torch.zeros(3))], version=99)
    assert weight_version(engine_url) != "99"
    sender.close()
    assert gen(engine_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_control_errors_are_engine_errors(engine_url):
    """A refused connection and an HTTP error status raise EngineError naming the call and the answer."""
    from slime_hydra.utils.proc import free_port

    with pytest.raises(EngineError, match="/health failed"):
        control(f"http://127.0.0.1:{free_port()}", "/health", method="GET", timeout=5)
    with pytest.raises(EngineError, match=r"/pause_generation -> HTTP 400"):
        control(engine_url, "/pause_generation", {"mode": "freeze"})
    with pytest.raises(EngineError, match=r"/destroy_weights_update_group -> HTTP 400: .*does not exist"):
        control(engine_url, "/destroy_weights_update_group", {"group_name": "never_made"})
    assert control(engine_url, "/health", method="GET") is None  # an empty body
    assert "weight_version" in control(engine_url, "/model_info", method="GET")


def test_release_and_resume_memory(engine_url, tiny_ckpt, tmp_path):
    """Colocated choreography: release all, resume weights, push weights, resume the cache."""
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    before = gen(engine_url, body)[1]["meta_info"]["output_token_logprobs"]
    control(engine_url, "/release_memory_occupation", {"tags": None})
    assert set(httpx.get(engine_url + "/server_info").json()["released_tags"]) >= {"weights", "kv_cache"}
    assert gen(engine_url, body)[0] == 503
    assert httpx.get(engine_url + "/health_generate").status_code == 503
    control(engine_url, "/resume_memory_occupation", {"tags": ["weights"]})
    sender = WeightSender("disk", [Endpoint(engine_url, 1)], torch.device("cpu"), 1, str(tmp_path), tiny_ckpt)
    sender.connect()
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    sender.push(list(model.state_dict().items()), version=0)
    control(engine_url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    after = gen(engine_url, body)[1]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in after] == [t for _, t, _ in before]
    # exact, including buffers the trainer does not push (rotary inv_freq survives the release)
    assert max(abs(a[0] - b[0]) for a, b in zip(after, before)) < 1e-6
    sender.close()


def test_without_the_memory_saver_release_and_resume_keep_the_weights(tiny_ckpt, tmp_path):
    """Colocated engines that do not offload (``parallelism.offload_rollout=false``) start without
    --enable-memory-saver. SGLang 0.5.17 then answers release and resume and keeps its memory and
    weights (its memory saver adapter is a no-op); the embedded server does the same."""
    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.rollout.engines.embedded import EmbeddedEngine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    spec = ServerSpec(engine="embedded", model_path=tiny_ckpt, tokenizer_path=tiny_ckpt, dtype="float32",
                      device="cpu", gpus=1, seed=0, num_threads=1, memory_saver=False)
    port = free_port()
    cmd = EmbeddedEngine(spec).command("127.0.0.1", port)
    assert "--enable-memory-saver" not in cmd
    url, log = f"http://127.0.0.1:{port}", str(tmp_path / "engine.log")
    proc = spawn(cmd, log)
    try:
        wait_http(url + "/health_generate", proc, 120, log)
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        before = gen(url, body)[1]["meta_info"]["output_token_logprobs"]
        control(url, "/release_memory_occupation", {"tags": None})
        assert httpx.get(url + "/server_info").json()["released_tags"] == []
        code, out = gen(url, body)
        assert code == 200 and out["meta_info"]["output_token_logprobs"] == before
        control(url, "/resume_memory_occupation", {"tags": None})
        assert weight_version(url) == "default" and gen(url, body)[1]["meta_info"]["output_token_logprobs"] == before
    finally:
        kill_tree(proc)


def test_control_errors_name_the_endpoint(engine_url):
    with pytest.raises(EngineError, match="destroy_weights_update_group"):
        control(engine_url, "/destroy_weights_update_group", {"group_name": "nope"})


def test_distributed_push_tensor_by_tensor(engine_url, tiny_ckpt, tmp_path):
    """SGLang's wire format without ``load_format``: one broadcast per tensor (the sender flattens
    each bucket into one broadcast; both must land)."""
    from concurrent.futures import ThreadPoolExecutor

    from slime_hydra.sync import transport
    from slime_hydra.sync.sender import GROUP_NAME

    model = _scaled_weights(tiny_ckpt, 1.5)
    named = list(model.state_dict().items())
    sender = WeightSender("distributed", [Endpoint(engine_url, 1)], torch.device("cpu"), 1, str(tmp_path), tiny_ckpt)
    sender.connect()
    try:
        body = {"names": [n for n, _ in named], "dtypes": ["float32"] * len(named), "group_name": GROUP_NAME,
                "shapes": [list(t.shape) for _, t in named], "weight_version": "8"}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(control, engine_url, "/update_weights_from_distributed", body)
            transport.broadcast_send(sender.group, [t for _, t in named])
            answer.result()
        assert weight_version(engine_url) == "8"
        out = gen(engine_url, {"input_ids": PROMPT, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})[1]
        engine = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(engine, recompute(model, PROMPT, out["output_ids"]))) < 1e-4
        original = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
        sender.push(list(original.state_dict().items()), version=0)
    finally:
        sender.close()


def test_unknown_load_format_is_refused(engine_url):
    with pytest.raises(EngineError, match="load_format"):
        control(engine_url, "/update_weights_from_distributed",
                {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "npz"})


def test_sampling_seed_fixes_the_tokens_whatever_the_batch(engine_url):
    """A request with ``sampling_seed`` samples the same tokens (and log-probs) alone, inside a batch
    at another position, padded next to a longer prompt, and among concurrent requests."""
    def sp(seed):
        return {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": seed}

    def alone(prompt, seed):
        return gen(engine_url, {"input_ids": prompt, "sampling_params": sp(seed), "return_logprob": True})[1]

    a, b = alone(PROMPT, 11), alone(PROMPT[:4], 7)
    batch = gen(engine_url, {"input_ids": [PROMPT[:3], PROMPT, PROMPT, PROMPT[:4]], "return_logprob": True,
                             "sampling_params": [sp(5), sp(12), sp(11), sp(7)]})[1]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(lambda s: alone(PROMPT, s), [11, 1, 2, 3, 11, 4, 5, 6]))
    for out, ref in [(batch[2], a), (batch[3], b), (crowd[0], a), (crowd[4], a)]:
        assert out["output_ids"] == ref["output_ids"]
        lps = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y[0]) for x, y in zip(lps, ref["meta_info"]["output_token_logprobs"])) < 1e-5
    assert len({tuple(o["output_ids"]) for o in crowd}) > 2  # other seeds sample other tokens


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from slime_hydra.rollout.engines.embedded.engine import EmbeddedModel

    return EmbeddedModel(tiny_ckpt)


def _first_tokens(engine, n, **params):
    from slime_hydra.rollout.engines.embedded.engine import Request, SamplingParams

    reqs = [Request(PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True, sampling_seed=i, **params), rid=str(i),
                    return_logprob=True) for i in range(n)]
    return [o["output_ids"][0] for o in engine.generate(reqs)]


def test_seeded_sampling_draws_from_the_distribution(engine):
    """Over 20000 seeds the first token's frequencies match the model's probabilities (total
    variation < 0.02; sampling error alone is about 0.01), and top_k keeps to the k likeliest."""
    with torch.no_grad():
        probs = engine.model(input_ids=torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    tokens = _first_tokens(engine, 20000)
    freq = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double() / len(tokens)
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.02
    top3 = set(probs.topk(3).indices.tolist())
    assert set(_first_tokens(engine, 500, top_k=3)) == top3


# ------------------------------------------------------------------ SGLang 0.5.17 as the reference
# Each test below pins one behaviour of the embedded server to what SGLang 0.5.17's own server does
# (sglang/srt/entrypoints/http_server.py, sglang/srt/managers/io_struct.py and tokenizer_manager.py).
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT().to_json()


def test_weight_version_endpoints_are_gone(engine_url):
    """0.5.17 answers both old paths with FastAPI's 404 ``{"detail": ...}``; the version is in /model_info."""
    for path in ("/get_weight_version", "/weight_version"):
        r = httpx.get(engine_url + path)
        assert r.status_code == 404 and "/model_info" in r.json()["detail"]


def test_model_info_has_sglang_fields(engine_url):
    info = httpx.get(engine_url + "/model_info").json()
    assert set(info) == {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                         "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}
    assert info["has_image_understanding"] is False and info["weight_version"] == weight_version(engine_url)


def test_generate_meta_info_as_sglang(engine_url, tiny_ckpt):
    """With return_logprob: (logprob, token id, None) triples, no prompt log-probs (logprob_start_len -1),
    their count; with return_text_in_logprobs the third element is the token's text."""
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    meta = gen(engine_url, body)[1]["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
            "completion_tokens", "cached_tokens", "input_token_logprobs", "output_token_logprobs",
            "output_token_logprobs_length"} <= set(meta)
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 4
    assert all(x is None for _, _, x in meta["output_token_logprobs"])
    out = gen(engine_url, {**body, "return_text_in_logprobs": True})[1]
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert [x for _, _, x in out["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in out["output_ids"]]
    assert "output_token_logprobs" not in gen(engine_url, {**body, "return_logprob": False})[1]["meta_info"]


def test_sampling_params_as_sglang_reads_them(engine_url):
    """null means the default; SGLang's verify() ranges; unknown keys and sampling features the
    embedded engine does not have are refused (400), not ignored."""
    ok = {"max_new_tokens": 2, "temperature": None, "top_p": None, "top_k": None, "stop": None,
          "stop_token_ids": None, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "json_schema": None}
    assert gen(engine_url, {"input_ids": PROMPT, "sampling_params": ok})[0] == 200
    for bad, needle in [({"top_k": 0}, "top_k"), ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
                        ({"min_p": 1.5}, "min_p"), ({"temperature": -0.5}, "temperature"),
                        ({"no_such_param": 1}, "no_such_param"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
                        ({"regex": "[0-9]+"}, "regex")]:
        code, out = gen(engine_url, {"input_ids": PROMPT, "sampling_params": bad})
        assert code == 400 and needle in out["error"]["message"], (bad, out)


def _paused_requests(engine_url, bodies):
    """Send ``bodies`` while generation is paused; returns their futures (nothing runs yet)."""
    import time

    control(engine_url, "/pause_generation", {"mode": "in_place"})
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies))
    futs = [pool.submit(gen, engine_url, b) for b in bodies]
    time.sleep(0.5)
    assert not any(f.done() for f in futs)
    return pool, futs


def test_abort_request_by_rid_reaches_waiting_requests(engine_url):
    """/abort_request answers an empty 200; a rid aborts that request, or every sample of a request with
    n > 1, waiting or running; other requests go on; an empty rid aborts nothing."""
    sp = {"max_new_tokens": 3, "ignore_eos": True}
    pool, futs = _paused_requests(engine_url, [{"input_ids": PROMPT, "rid": "one", "sampling_params": sp},
                                               {"input_ids": PROMPT, "rid": "many", "sampling_params": {**sp, "n": 2}},
                                               {"input_ids": PROMPT, "rid": "other", "sampling_params": sp}])
    try:
        for rid in ("one", "many", ""):
            r = httpx.post(engine_url + "/abort_request", json={"rid": rid})
            assert r.status_code == 200 and r.content == b""
        control(engine_url, "/continue_generation", {})
        one, many, other = [f.result() for f in futs]
    finally:
        pool.shutdown()
    assert one[1]["meta_info"]["finish_reason"] == ABORTED and one[1]["output_ids"] == []
    assert [o["meta_info"]["finish_reason"] for o in many[1]] == [ABORTED, ABORTED]
    assert other[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_update_weight_version_aborts_by_default(engine_url):
    """UpdateWeightVersionReqInput.abort_all_requests defaults to true."""
    before = weight_version(engine_url)
    pool, futs = _paused_requests(engine_url, [{"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}])
    try:
        out = control(engine_url, "/update_weight_version", {"new_version": "v-test"})
        control(engine_url, "/continue_generation", {})
        assert futs[0].result()[1]["meta_info"]["finish_reason"] == ABORTED
    finally:
        pool.shutdown()
        control(engine_url, "/update_weight_version", {"new_version": before})
    assert out == {"success": True, "message": "Weight version updated to v-test", "new_version": "v-test"}


def test_pause_generation_modes(engine_url):
    r = httpx.post(engine_url + "/pause_generation", json={"mode": "freeze"})
    assert r.status_code == 400 and "in_place" in r.json()["error"]["message"]
    for mode in ("retract", "in_place", "abort"):
        assert control(engine_url, "/pause_generation", {"mode": mode}) == {
            "message": "Generation paused successfully.", "status": "ok"}
        control(engine_url, "/continue_generation", {"torch_empty_cache": True})
    assert gen(engine_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_legacy_load_and_flush_answers(engine_url):
    loads = httpx.get(engine_url + "/get_load").json()
    assert isinstance(loads, list) and set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                                                         "num_pending_tokens", "ts_tic"}
    assert httpx.post(engine_url + "/flush_cache").text.startswith("Cache flushed.\n")


def test_update_weights_from_tensor_load_formats(engine_url, tiny_ckpt):
    """None and "direct": a list of (name, tensor); "flattened_bucket": SGLang's bytes bucket; another
    format, or a payload with classes SGLang's SafeUnpickler refuses, is a 400 and changes nothing."""
    import pathlib

    from slime_hydra.sync import transport

    torch.multiprocessing.set_sharing_strategy("file_system")
    model = _scaled_weights(tiny_ckpt, 1.25)
    named = [(k, v.contiguous()) for k, v in model.state_dict().items()]
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}

    def check_policy(m):
        out = gen(engine_url, body)[1]
        engine = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(engine, recompute(m, PROMPT, out["output_ids"]))) < 1e-4

    original = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    try:
        for fmt, payload in [(None, named), ("direct", named),
                             ("flattened_bucket", transport.flattened_bucket(named, torch.device("cpu")))]:
            control(engine_url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [transport.serialize(payload)], "load_format": fmt,
                "weight_version": f"fmt-{fmt}"})
            assert weight_version(engine_url) == f"fmt-{fmt}"
            check_policy(model)
            control(engine_url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [transport.serialize(list(original.state_dict().items()))]})
            check_policy(original)
        for fmt, payload, needle in [("npz", named, "Unknown load_format"),
                                     (None, [("x", pathlib.Path("/tmp"))], "pathlib")]:
            with pytest.raises(EngineError, match=needle):
                control(engine_url, "/update_weights_from_tensor", {
                    "serialized_named_tensors": [transport.serialize(payload)], "load_format": fmt,
                    "weight_version": "refused"})
            assert weight_version(engine_url) != "refused"
    finally:
        control(engine_url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [transport.serialize(list(original.state_dict().items()))],
            "weight_version": "0"})


def test_update_weights_from_disk_answer(engine_url, tiny_ckpt):
    out = control(engine_url, "/update_weights_from_disk", {"model_path": tiny_ckpt, "weight_version": "0"})
    assert out["success"] is True and out["num_paused_requests"] == 0


def test_tied_lm_head_is_pushed_once(engine_url, tiny_ckpt, tmp_path):
    """The torch backend names the tied embedding once (SGLang's loaders warn for lm_head.weight and tie
    it themselves); the embedded engine ties it too, so the pushed policy lands whole."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "train"))
    from tiny_trainer import backend, config

    be = backend(config(), tiny_ckpt)
    assert be.model.config.tie_word_embeddings
    with torch.no_grad():
        be.model.get_input_embeddings().weight.mul_(1.5)
    names = [n for n, _ in be.hf_weights()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    sender = WeightSender("tensor", [Endpoint(engine_url, 1)], torch.device("cpu"), 1, str(tmp_path), tiny_ckpt)
    try:
        sender.push(be.hf_weights(), version=21)
        out = gen(engine_url, {"input_ids": PROMPT, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})[1]
        engine = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(engine, recompute(be.model.eval(), PROMPT, out["output_ids"]))) < 1e-4
        original = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
        sender.push(list(original.state_dict().items()), version=0)
    finally:
        sender.close()


# --------------------------------------------- the trainer's wire format, read by SGLang's own code
@pytest.fixture(scope="module")
def sglang():
    from sglang_parser import start_parser

    parser = start_parser()
    yield parser
    parser.close()


def test_sglang_reads_the_tensor_payload(sglang):
    """SGLang 0.5.17's MultiprocessingSerializer (its SafeUnpickler) and FlattenedTensorBucket read what
    the sender sends, flattened and as a list (CPU tensors here: the CUDA path is the same pickle with a
    CUDA handle, `python bench/run.py anchor`)."""
    from slime_hydra.sync import transport

    torch.multiprocessing.set_sharing_strategy("file_system")
    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(7, 4, generator=g).to(torch.bfloat16)),
             ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
             ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16))]
    expected = [[n, list(t.shape), str(t.dtype), float(t.double().sum())] for n, t in named]
    bucket = transport.flattened_bucket(named, torch.device("cpu"))
    assert sglang.read_tensor_payload(transport.serialize(bucket), "flattened_bucket") == expected
    assert sglang.read_tensor_payload(transport.serialize(named), None) == expected


def test_distributed_bucket_is_sglang_layout(sglang):
    """The flattened broadcast has the byte layout SGLang's receiver allocates (uint8, tensors end to end):
    a bf16 bucket of N elements is 2N bytes, not N elements."""
    from slime_hydra.sync import transport

    shapes = [[7, 4], [4], [3, 5]]
    names = ["a", "b", "c"]
    mine = transport.bucket_metadata([(n, torch.bfloat16, s) for n, s in zip(names, shapes)])
    theirs = sglang.bucket_layout(names, ["bfloat16"] * 3, shapes)
    assert theirs["dtype"] == "torch.uint8" and theirs["numel"] == mine[-1].end_idx == 2 * (28 + 4 + 15)
    assert theirs["entries"] == [[m.name, m.start_idx, m.end_idx] for m in mine]
    flat = transport.flatten([torch.ones(s, dtype=torch.bfloat16) for s in shapes], torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == theirs["numel"]


def test_disk_push_of_a_version_pushed_before(engine_url, tiny_ckpt, tmp_path):
    """A resumed run pushes its step's version again: the directory of that version is replaced."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    sender = WeightSender("disk", [Endpoint(engine_url, 1)], torch.device("cpu"), 1, str(tmp_path), tiny_ckpt)
    sender.connect()
    try:
        for _ in range(2):
            sender.push(list(model.state_dict().items()), version=0)
    finally:
        sender.close()
    assert [d for d in os.listdir(tmp_path) if d.startswith("weights_v")] == ["weights_v000000"]
