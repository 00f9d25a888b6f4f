"""SFT's rollout function (``algo=sft``, as slime's ``sft_rollout``): each prompt's response is its label, not
a sample, so no engine is asked; the rows then go through the same training data, packing and micro-batches
as an RL rollout. The response is the label's tokens and the tokenizer's end-of-sequence token (the prompt
tokens stay out of the loss: only the response is), cut at ``rollout.max_response_len``. A row of chat messages
whose last turn is the assistant's has that turn as its label (:func:`slime_hydra.data.dataset.parse_row`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from slime_hydra.data.sample import Sample, Status

if TYPE_CHECKING:
    from slime_hydra.rollout.rollout_fn import RolloutContext, RolloutOutput


def label_response(sample: Sample, tokenizer, max_len: int) -> Sample:
    """``sample`` with its label as the response: tokens, a loss mask of ones, log-probs 0 (none were sampled)."""
    if sample.label is None:
        raise ValueError(f"{sample.identity()}: algo=sft trains on labels, and this row has none (data.label_key "
                         "names the response column; chat rows may end with the assistant's turn)")
    encode = tokenizer.encode
    prompt = encode(sample.prompt, add_special_tokens=False) if isinstance(sample.prompt, str) else list(sample.prompt)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    response = (encode(str(sample.label), add_special_tokens=False) + eos)[:max_len]
    sample.tokens, sample.response_length = prompt + response, len(response)
    sample.response = tokenizer.decode(response)
    sample.loss_mask, sample.rollout_log_probs = [1] * len(response), [0.0] * len(response)
    sample.status, sample.reward = Status.COMPLETED, 0.0  # the held-out reward is eval's
    return sample


async def sft_rollout(ctx: "RolloutContext", rollout_id: int, weight_version: Optional[str] = None) -> "RolloutOutput":
    """``rollout.batch_size`` groups of labelled rows, in data order."""
    r = ctx.cfg.rollout
    tokenizer = ctx.sampler.ctx.tokenizer
    groups: List[List[Sample]] = ctx.source.get_samples(r.batch_size)
    for group in groups:
        for s in group:
            label_response(s, tokenizer, r.max_response_len)
    return groups, {}
