"""The SGLang engine: ``engine`` (the server's command line and environment), ``args`` (``rollout.server_args``
checked by sglang's parser), ``launch`` (what slime_hydra adds to the server's arguments), ``fast_start`` (the
start-up work behind ``rollout.sglang_fast_start``)."""
