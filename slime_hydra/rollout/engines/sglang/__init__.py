"""The SGLang engine: ``engine`` (command line, environment), ``args`` (``rollout.server_args`` checked by sglang's
parser), ``launch`` (what slime_hydra adds to them), ``fast_start`` (``rollout.sglang_fast_start``)."""
