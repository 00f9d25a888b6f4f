"""A reward hook that fails on purpose: the job of a sweep that uses it fails at its first rollout, as a
job with bad data for one value would, and the other jobs must not notice."""


def broken(cfg, sample):
    raise ValueError("this reward is broken on purpose")
