"""``rollout.agent=verifiers``: a verifiers (``verifiers.v1``) taskset's episodes against the sample's session.

``rollout.agent_env`` names an installed taskset (its module name, or a hub id ``owner/name``). Each sample runs
one episode of its task: verifiers' own agent, interception server and trace, the task's rewards (its
``@vf.reward`` functions and judges) as the sample's reward. The episode runs in this process: the subprocess
runtime and the tool-less chat of verifiers' ``null`` harness, sent without streaming, so the session records the
engine's tokens. verifiers' stock harnesses run a program through ``uv`` (which needs the network), so tasksets
whose tasks need tools, a container or their own harness are refused. The dataset is the taskset's tasks
(``data.source=verifiers``) unless ``data.path`` is given; then each row's prompt and metadata are its task's data.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Dict

from slime_hydra.data.tasksets import tasks, taskset


@functools.cache
def _harness() -> Any:
    """verifiers' null harness (one chat turn, no tools), in process: no ``uv`` program to prepare. Its episodes
    share one HTTP connection pool per event loop (a fresh pool loads the CA bundle again)."""
    import httpx
    import openai
    from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
    from verifiers.v1.runtimes import ProgramResult

    class InProcess(NullHarness):
        SUPPORTS_MCP = SUPPORTS_TOOL_INTERCEPTION = False

        async def setup(self, runtime: Any) -> None:
            pass

        async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any,
                         data: Any, tool_interception_url: Any = None) -> Any:
            system, prompt = self.resolve_prompt(data)
            messages = ([{"role": "system", "content": system}] if system else []) + (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [m.model_dump(exclude_none=True) for m in prompt or []])
            if getattr(self, "loop", None) is not asyncio.get_running_loop():
                self.loop, self.http = asyncio.get_running_loop(), httpx.AsyncClient(timeout=None)
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=self.http)
            await client.chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    return InProcess(NullHarnessConfig(id="null"))


def _task(env: str, sample: Dict[str, Any]) -> Any:
    ts, md = taskset(env), sample["metadata"]
    if "vf_task" in md:
        return tasks(env)[md["vf_task"]]
    from verifiers.v1.task import TaskData
    from verifiers.v1.utils.generic import concrete_type

    data_cls = concrete_type(type(ts).task_type(), TaskData) or TaskData
    fields = {k: v for k, v in md.items() if k in data_cls.model_fields}
    return type(ts).task_type()(data_cls(prompt=sample["prompt"], **fields), ts.config.task)


async def run(base_url: str, sample: Dict[str, Any], *, env: str, model: str) -> float:
    """One episode of the sample's task on the session ``base_url``; its reward (a failed episode raises)."""
    import verifiers.v1 as vf

    agent = vf.Agent(vf.AgentConfig(model=model, runtime=vf.SubprocessConfig(),
                                    client=vf.EvalClientConfig(base_url=base_url, api_key_var="SLIME_HYDRA_VF_KEY"),
                                    harness=vf.HarnessConfig(id="null")))
    agent.harness = _harness()
    async with agent:
        trace = await agent.run(_task(env, sample))
    if not trace.ok:
        raise RuntimeError(f"the verifiers episode failed: {trace.errors}")
    return trace.reward


def agent(cfg: Any) -> Any:
    """The agent behind ``rollout.agent=verifiers``."""
    taskset(cfg.rollout.agent_env)
    return functools.partial(run, env=cfg.rollout.agent_env, model=cfg.model.name or "slime_hydra")
