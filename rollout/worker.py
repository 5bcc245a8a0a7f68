"""vLLM generation workers: Ray actors that sample G completions per prompt with the current policy.

A call returns each prompt group as its own return value (stored in the object store and owned
by the caller, so a worker that dies later loses nothing it finished), then one dict of stats.
The payloads go from worker to learner without the driver ever fetching them.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common import heap
from common.config import RolloutConfig
from common.errors import RunFailed
from common.messages import ChunkReport, GenerationRequest
from common.prompt_group import PromptGroup
from common.reaper import start_reaper
from rollout import texts
from rollout.engine import VllmStepEngine
from rollout.engine_log import StderrTail, root_cause
from common.seeds import call_seed, sample_seed, turn_seed

RECEIVER_CLASS = "rollout.weight_receiver.WeightReceiver"


class EngineStartError(RunFailed):
    """A vLLM engine failed to start; the message is one line with the root cause."""


EXIT_ENGINE_DEAD = 70
"""The actor's exit status when its engine died under it."""


def engine_died(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is vLLM's EngineDeadError: its engine core process is
    gone, and every later call on this engine would fail the same way."""
    from vllm.v1.engine.exceptions import EngineDeadError

    while error is not None:
        if isinstance(error, EngineDeadError):
            return True
        error = error.__cause__
    return False


def exits_if_engine_died(method):
    """The actor process exits when its engine died during `method`: Ray then restarts it with
    a fresh engine (max_restarts) and the pool re-syncs it, where an actor left alive with a
    dead engine would fail every call and never be restarted."""
    def exit_if_dead(error: BaseException) -> None:
        if engine_died(error):
            print(f"the vLLM engine died ({type(error).__name__}): exiting so that Ray restarts this actor",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_ENGINE_DEAD)

    if inspect.isgeneratorfunction(method):  # a streaming call: its errors come while it yields
        @functools.wraps(method)
        def streaming(self, *args, **kwargs):
            try:
                yield from method(self, *args, **kwargs)
            except Exception as error:
                exit_if_dead(error)
                raise
        return streaming

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            exit_if_dead(error)
            raise
    return wrapper


def no_compile() -> None:
    """No torch.compile in this process or the processes it starts (a tensor-parallel engine's
    ranks), for an eager engine on CPUs. vLLM's sampler still compiles one helper (the rank of
    each sampled token among the logits, which every log-prob request computes) the first time a
    request asks for log-probs: on CPUs Inductor then writes and compiles C++, most of the first
    training step of every engine, while later calls are the same either way (bench/first_sample.py).
    An eager engine compiles nothing else."""
    import torch._dynamo

    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # torch reads it at import: a rank process started fresh
    os.environ["TORCHDYNAMO_DISABLE"] = "1"    # read by torch.compile itself, when it wraps a function
    torch._dynamo.config.disable = True         # this process, whose torch is imported already


class GenerationWorker:
    """One vLLM engine (one Ray actor): the GenerationBackend (common/backends.py) of every run.
    `policy_version` is the version of the weights it holds."""

    @heap.started_without_full_collections  # vLLM's import and its engine's start
    def __init__(self, model_path: str, rollout_cfg: RolloutConfig, seed: int):
        from vllm.platforms import current_platform

        self.cfg = rollout_cfg
        self.seeded = sampling_is_seeded(rollout_cfg.seeded_sampling, not current_platform.is_cpu())
        # On CPU the KV cache is a fixed size (fractions of a GiB allowed, unlike the legacy
        # VLLM_CPU_KVCACHE_SPACE, which still wins if set); on GPU gpu_memory_utilization rules.
        kv_bytes = int(rollout_cfg.kv_cache_gib * 2**30) if current_platform.is_cpu() else None
        tp = rollout_cfg.tensor_parallel_size
        if tp > 1 and current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's CPU build binds each TP rank's threads to a NUMA node of its own and refuses
            # more ranks than nodes; a one-node machine splits its CPUs between the ranks instead.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), tp)
        if rollout_cfg.engine_core != "auto" or "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
            # The engine core inside this actor on CPUs: its own process re-imports torch and
            # vLLM at start and every generate call pays a round trip to it (bench/end_to_end.py:
            # start-up and steps both faster). A tensor-parallel engine's ranks stay processes of
            # vLLM's `mp` executor. On GPUs vLLM's own process overlaps scheduling with the GPU's
            # work: kept there. A setting of rollout.engine_core wins over the variable, which a
            # process can inherit from whatever ran an engine in its parent before Ray started.
            in_actor = engine_core_in_actor(rollout_cfg.engine_core, not current_platform.is_cpu())
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_actor else "1"
        if current_platform.is_cpu() and rollout_cfg.enforce_eager:
            no_compile()
        if tp == 1 and current_platform.is_cpu() and rollout_cfg.num_threads:
            import torch

            # Before the engine starts: vLLM's CPU worker refuses set_num_threads afterwards.
            torch.set_num_threads(rollout_cfg.num_threads)
        self._stderr = StderrTail()
        try:
            self.llm = self._start_engine(model_path, kv_bytes, tp, seed)
        except Exception as error:
            cause = root_cause(self._stderr.text()) or f"{type(error).__name__}: {error}"
            raise EngineStartError(f"the vLLM engine did not start: {cause.splitlines()[0][:500]}") from None
        # Engine processes (the engine core, tensor-parallel ranks) die with this actor however
        # it dies, before the agents' and tools' processes, which watch it themselves, start.
        self._reaper = start_reaper()
        self.engine = VllmStepEngine(self.llm)  # what the multi-turn loops step
        self._track_engine()
        self.lora_request = None  # the adapter version served on the base, once one was pushed
        self._lora_pushes = 0
        # Training samples' texts are decoded here, once, when vLLM need not (rollout/texts.py).
        self._rust_tokenizer = texts.fast_tokenizer(self.llm.get_tokenizer())
        self.tools = self.format = None
        if rollout_cfg.episodes:
            self._start_tools()
        self.agents = None
        if rollout_cfg.agent is not None:
            self._start_agents(model_path)

    def _start_agents(self, model_path: str) -> None:
        from rollout.agents import AgentPool
        from rollout.endpoint import AgentEndpoint, EngineBridge
        from rollout.sessions import SessionStore

        c = self.cfg
        self.tokenizer = self.llm.get_tokenizer()
        self.sessions, self.bridge = SessionStore(), EngineBridge()
        self._agent_call: Dict[str, Any] = {}
        self.endpoint = AgentEndpoint(self.tokenizer, self._agent_sampling, self.sessions, self.bridge,
                                      os.path.basename(model_path.rstrip("/")), c.endpoint_host,
                                      c.endpoint_max_request_kb, c.max_model_len)
        self.agents = AgentPool(c.agent, c.agent_concurrency, c.agent_timeout_s, search_path=[os.getcwd()],
                                per_process=c.agent_episodes_per_process)

    def _start_tools(self) -> None:
        from common.sandbox import MARGIN_S as SANDBOX_MARGIN_S
        from common.sandbox import SandboxLimits
        from common.tool_formats import make_format
        from rollout.tools import ToolBox

        c = self.cfg
        self.tokenizer = self.llm.get_tokenizer()
        self.format = make_format(c.tool_format, self.tokenizer)
        # The sandbox ends a slow program itself a little before the box stops waiting: cheaper
        # than abandoning the call.
        sandbox = SandboxLimits(timeout_s=max(c.tool_timeout_s - SANDBOX_MARGIN_S, 0.1))
        self.tools = ToolBox(c.tools, c.custom_tools, c.tool_timeout_s, c.tool_max_output_chars, sandbox,
                             search_path=[os.getcwd()])

    def _start_engine(self, model_path: str, kv_bytes, tp: int, seed: int):
        from vllm import LLM

        heap.freeze_heap()  # vLLM's start runs five full collections itself: not over the imported stack

        rollout_cfg = self.cfg
        cpu = {}
        if kv_bytes is not None:
            # On CPUs no prompt is prefilled in pieces: when vLLM discards the token sampled after
            # a partial prefill it rewinds the request's seeded generator, which a CPU generator
            # cannot do ("CPU Generator does not use offset"; seen with a large batch of long
            # chat prompts). A step's token budget then holds at least one whole sequence.
            cpu = {"enable_chunked_prefill": False,
                   "max_num_batched_tokens": max(rollout_cfg.max_model_len, 8192)}
        return LLM(
            **cpu,
            kv_cache_memory_bytes=kv_bytes,
            model=model_path,
            dtype=rollout_cfg.dtype,
            max_model_len=rollout_cfg.max_model_len,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            tensor_parallel_size=tp,
            # Tensor-parallel ranks as processes inside this actor, on the GPUs Ray gave it (its
            # CUDA_VISIBLE_DEVICES): vLLM's Ray executor would look for GPUs this actor already
            # holds, and refuses bundles of several GPUs. One rank: no executor processes at all.
            distributed_executor_backend="mp" if tp > 1 else None,
            enforce_eager=rollout_cfg.enforce_eager,
            seed=seed,
            worker_extension_cls=RECEIVER_CLASS,
            # Log-probs of the distribution actually sampled from (after temperature, top-k,
            # top-p): the behaviour policy of the importance weights in the loss.
            logprobs_mode="processed_logprobs",
            # Partial rollouts load weights while requests run, when reset_prefix_cache() cannot
            # drop the cached prefixes: a new request would reuse the old weights' prompt KV.
            **({"enable_prefix_caching": False} if rollout_cfg.partial else {}),
            **lora_options(rollout_cfg.max_lora_rank),
        )

    def _track_engine(self) -> None:
        """The weights' version (0 until the first push; the engine labels each sampled span
        with it), the streaming requests carried between calls, and a count of every step of
        the engine and the seconds inside them, whoever steps it (`LLM.generate`, the multi-turn
        loops, the streaming calls) and of the tokens its steps sampled: slot occupancy is tokens
        sampled / (steps x max_num_seqs), generation throughput tokens / seconds in steps. The
        tokens are counted as each step's outputs reach the output processor, so a streaming
        sample is counted in the call whose steps sampled it, not the call it finished in."""
        import time

        self.policy_version = 0
        self.llm.llm_engine.set_weight_version("0")
        self.stream = StreamState()
        engine, step = self.llm.llm_engine, self.llm.llm_engine.step
        self.engine_clock = {"engine_steps": 0.0, "time_engine": 0.0, "sampled_tokens": 0.0}
        self.max_num_seqs = engine.vllm_config.scheduler_config.max_num_seqs
        processor = engine.output_processor
        process = processor.process_outputs

        def counted_outputs(outputs, *args, **kwargs):
            self.engine_clock["sampled_tokens"] += sum(len(out.new_token_ids) for out in outputs)
            return process(outputs, *args, **kwargs)

        processor.process_outputs = counted_outputs

        def counted_step():
            started = time.perf_counter()
            try:
                return step()
            finally:
                self.engine_clock["engine_steps"] += 1
                self.engine_clock["time_engine"] += time.perf_counter() - started

        engine.step = counted_step

    def _clock_since(self, before: Dict[str, float]) -> Dict[str, float]:
        """Engine steps, their seconds, slots (steps x max_num_seqs) and sampled tokens since
        `before`."""
        steps = self.engine_clock["engine_steps"] - before["engine_steps"]
        return {"engine_steps": steps, "time_engine": self.engine_clock["time_engine"] - before["time_engine"],
                "engine_slots": steps * self.max_num_seqs,
                "sampled_tokens": self.engine_clock["sampled_tokens"] - before["sampled_tokens"]}

    def ready(self) -> int:
        return self.policy_version

    def batch_slots(self) -> int:
        """Sequences one engine step runs at most (vLLM's max_num_seqs)."""
        return self.max_num_seqs

    def sync_ranks(self) -> int:
        return self.cfg.tensor_parallel_size

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        from common.ray_utils import node_ip

        return node_ip()

    def sampling_params(self, n: int, greedy: bool, seed: int, temperature: Optional[float] = None,
                        max_tokens: Optional[int] = None, detokenize: bool = True):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        c = self.cfg
        stop = list(c.stop) + (list(self.format.stop) if self.format is not None else [])
        return SamplingParams(
            n=n,
            temperature=0.0 if greedy else c.temperature if temperature is None else temperature,
            top_p=1.0 if greedy else c.top_p,
            top_k=0 if greedy else c.top_k,
            max_tokens=c.max_new_tokens if max_tokens is None else max_tokens,
            min_tokens=0 if greedy or max_tokens is not None else c.min_new_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,  # what LLM.generate sets too; episodes need it
            stop=stop or None,
            stop_token_ids=list(c.stop_token_ids) or None,  # the chat format's end of turn
            include_stop_str_in_output=c.include_stop_str,
            seed=seed,
            logprobs=None if greedy else 0,  # 0: just the sampled token's log-prob
            detokenize=detokenize or bool(stop),  # stop strings are matched on vLLM's text
        )

    @exits_if_engine_died
    def generate(self, *requests: GenerationRequest, n: int, greedy: bool,
                 temperature: Optional[float] = None) -> Tuple[Any, ...]:
        """Sample `n` completions for each request, with its seed: reproducible whichever worker
        runs it. Returns the groups, then a ChunkReport. `temperature` replaces
        rollout.temperature (evaluation samples at eval.temperature)."""
        version = self.policy_version  # weights change only between calls, never during one
        seeds = self._request_seeds([r.seed for r in requests], greedy)
        clock = dict(self.engine_clock)
        if self.tools is not None or self.agents is not None:
            run = self._episodes if self.tools is not None else self._agent_episodes
            *groups, report = run(requests, n, greedy, seeds, temperature, version)
            report.stats.update(self._clock_since(clock))
            return (*groups, report)
        rust = self._rust_tokenizer
        params = [self.sampling_params(n, greedy, seed, temperature, detokenize=rust is None) for seed in seeds]
        if self.stream.pending:
            # Streaming requests live in this engine between calls: LLM.generate would drain
            # (and swallow) them, so these requests are stepped beside them instead.
            outputs = self._generate_beside_stream(requests, params)
        else:
            outputs = self.llm.generate([r.prompt for r in requests], params, use_tqdm=False,
                                        lora_request=self.lora_request)
        groups = [self._group(request, out, sp, greedy, version) for request, out, sp in zip(requests, outputs, params)]
        stats = {
            "completions": float(sum(g.group_size for g in groups)),
            "completion_tokens": float(sum(len(ids) for g in groups for ids in g.completion_ids)),
            **self._clock_since(clock),
        }
        return (*groups, ChunkReport(stats, versions=(version,) * len(groups)))

    def _group(self, request: GenerationRequest, out, sp, greedy: bool, version: int,
               spans: Optional[List[List[Tuple[int, int, int]]]] = None) -> PromptGroup:
        """The PromptGroup of one finished vLLM RequestOutput."""
        rust = self._rust_tokenizer
        return PromptGroup(
            index=request.index,
            prompt=request.prompt,
            answer=request.answer,
            fields=dict(request.fields),
            prompt_ids=list(out.prompt_token_ids),
            completions=[c.text if sp.detokenize else texts.completion_text(
                rust, out.prompt_token_ids, c.token_ids, c.finish_reason == "stop", sp.include_stop_str_in_output,
                sp.skip_special_tokens) for c in out.outputs],
            completion_ids=[list(c.token_ids) for c in out.outputs],
            finish_reasons=[c.finish_reason or "length" for c in out.outputs],
            policy_version=version,
            sampler_logprobs=None if greedy else [_sampled_logprobs(c) for c in out.outputs],
            version_spans=spans,
        )

    def _add(self, request_id: str, prompt: str, params) -> None:
        self.llm.llm_engine.add_request(request_id, prompt, params, lora_request=self.lora_request)

    def _step_stream(self) -> List[Any]:
        """One engine step; finished streaming requests are kept for the next `advance`, the
        other finished outputs are returned."""
        others = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            if out.request_id in self.stream.pending:
                self.stream.finished.append(out)
            else:
                others.append(out)
        return others

    def _generate_beside_stream(self, requests: Sequence[GenerationRequest], params) -> List[Any]:
        """`LLM.generate`'s outputs, stepped beside the streaming requests the engine holds."""
        ids = [f"call-{next(self.stream.numbers)}" for _ in requests]
        for request_id, request, sp in zip(ids, requests, params):
            self._add(request_id, request.prompt, sp)
        done: Dict[str, Any] = {}
        while len(done) < len(ids):
            done.update((out.request_id, out) for out in self._step_stream())
        return [done[i] for i in ids]

    @exits_if_engine_died
    def advance(self, *requests: GenerationRequest, tickets: Sequence[int], n: int, max_steps: int,
                return_after: int = 1):
        """Streaming (rollout.streaming): add `requests` (the driver's `tickets` name them) to
        the requests this engine carries, run at most `max_steps` engine steps, and yield each
        group that finished, then one StreamReport. Requests still running stay in the engine
        for the next call; a weight push between two calls reaches them mid-sample
        (rollout.partial), and each sample records the versions of its spans."""
        from common.messages import StreamReport

        stream = self.stream
        seeds = [r.seed for r in requests] if self.seeded else [None] * len(requests)
        clock = dict(self.engine_clock)
        for ticket, request, seed in zip(tickets, requests, seeds):
            params = self.sampling_params(n, False, seed, detokenize=self._rust_tokenizer is None)
            request_id = f"stream-{next(stream.numbers)}"
            stream.pending[request_id] = (ticket, request, params)
            self._add(request_id, request.prompt, params)
        steps, engine = 0, self.llm.llm_engine
        # Finished requests stay in `pending` until returned below: the engine itself says whether
        # any still runs (a step of an empty engine whose core is a process of its own waits for
        # work forever; in the actor it would count empty steps into the occupancy).
        while engine.has_unfinished_requests() and len(stream.finished) < return_after and steps < max_steps:
            self._step_stream()
            steps += 1
        done_tickets, versions, newest, lengths, version_tokens = [], [], [], [], []
        while stream.finished:
            out = stream.finished.pop(0)
            ticket, request, params = stream.pending.pop(out.request_id)
            spans = [version_spans(c, self.policy_version) for c in out.outputs]
            oldest = min(v for sample in spans for v, _, _ in sample) if any(spans) else self.policy_version
            yield self._group(request, out, params, False, oldest, spans)
            done_tickets.append(ticket)
            versions.append(oldest)
            newest.append(max((v for sample in spans for v, _, _ in sample), default=oldest))
            lengths.append(tuple(len(c.token_ids) for c in out.outputs))
            counts: Dict[int, int] = {}
            for sample in spans:
                for v, start, end in sample:
                    counts[v] = counts.get(v, 0) + end - start
            version_tokens.append(tuple(sorted(counts.items())))
        stats = {"completions": float(sum(len(x) for x in lengths)),
                 "completion_tokens": float(sum(sum(x) for x in lengths)), **self._clock_since(clock)}
        yield StreamReport(tickets=tuple(done_tickets), versions=tuple(versions), newest=tuple(newest),
                           lengths=tuple(lengths), version_tokens=tuple(version_tokens), stats=stats,
                           running=len(stream.pending))

    def abort_stream(self) -> int:
        """Drop every streaming request this engine carries (the driver's stream stopped);
        returns how many there were."""
        ids = list(self.stream.pending)
        if ids:
            self.llm.llm_engine.abort_request(ids)
        self.stream = StreamState()
        return len(ids)

    def _agent_episodes(self, *args) -> Tuple[Any, ...]:
        from rollout.agent_episodes import run_agents

        return run_agents(self, *args)

    def _request_seeds(self, seeds: Sequence[int], greedy: bool) -> Sequence[Optional[int]]:
        """The seeds the requests carry: the prompts' own (rollout.seeded_sampling), or none,
        the engine's sampler then seeded once for the call from the prompts' seeds."""
        if self.seeded or greedy:
            return seeds
        self.llm.collective_rpc("reseed", args=(call_seed(seeds),))
        return [None] * len(seeds)

    def _episodes(self, requests: Sequence[GenerationRequest], n: int, greedy: bool,
                  seeds: Sequence[Optional[int]], temperature, version: int) -> Tuple[Any, ...]:
        """`generate` with tools: n multi-turn episodes per prompt, all advancing together."""
        from rollout.episodes import Episode, Limits, run_episodes

        c = self.cfg
        episodes = [Episode(prompt_ids=self.tokenizer(r.prompt)["input_ids"],
                            seed=None if greedy or seed is None else sample_seed(seed, j))
                    for r, seed in zip(requests, seeds) for j in range(n)]

        def params(ep, turn: int, max_tokens: int):
            seed = None if ep.seed is None else turn_seed(ep.seed, turn)
            return self.sampling_params(1, greedy, seed, temperature, max_tokens)

        limits = Limits(c.max_turns, c.max_new_tokens, c.completion_budget, c.max_model_len)
        stats = run_episodes(self.engine, self.tokenizer, episodes, params, self.tools, self.format, limits, greedy)
        groups: List[PromptGroup] = []
        for k, request in enumerate(requests):
            mine = episodes[k * n:(k + 1) * n]
            groups.append(PromptGroup(
                index=request.index, prompt=request.prompt, answer=request.answer, fields=dict(request.fields),
                prompt_ids=mine[0].prompt_ids, completions=["".join(e.model_text) for e in mine],
                completion_ids=[e.ids for e in mine], finish_reasons=[e.finish for e in mine], policy_version=version,
                sampler_logprobs=None if greedy else [e.logprobs for e in mine],
                loss_masks=[e.mask for e in mine], transcripts=["".join(e.transcript) for e in mine],
            ))
        stats = {"completions": float(len(episodes)),
                 "completion_tokens": float(sum(len(e.ids) for e in episodes)), **stats}
        return (*groups, ChunkReport(stats, versions=(version,) * len(groups)))

    def _agent_sampling(self, n: int, temperature, top_p, max_tokens: int, stop, seed, turn, trained: bool):
        """SamplingParams of one endpoint request. A trained turn samples at the run's settings
        (the learner's log-probs are computed at them) with the session's seed for that turn; a
        call off the chain takes the request's own."""
        session_id, index = turn
        call = self._agent_call
        base = call.get("seeds", {}).get(session_id)
        greedy = call.get("greedy", False)
        seed_for_turn = None if base is None else turn_seed(base, index)
        params = self.sampling_params(n, greedy, seed_for_turn if trained or seed is None else seed,
                                      call.get("temperature") if trained else temperature, max_tokens)
        if not trained and top_p is not None:
            params.top_p = top_p
        if stop:
            params.stop = list(params.stop or []) + ([stop] if isinstance(stop, str) else list(stop))
        return params

    def endpoint_address(self) -> str:
        """Where the agents' endpoint listens (host:port); empty without an agent."""
        return "" if self.agents is None else f"{self.endpoint.host}:{self.endpoint.port}"

    @exits_if_engine_died
    def init_weight_sync(self, host: str, port: int, base_rank: int, world_size: int, timeout_s: float,
                         backend: str) -> None:
        """Every vLLM worker process of this engine (one per tensor-parallel rank) joins the group."""
        self.llm.collective_rpc("init_weight_sync", args=(host, port, base_rank, world_size, timeout_s, backend))

    @exits_if_engine_died
    def receive_weights(self, wire_spec: dict, version: int) -> dict:
        """Load new weights from the sync group; report the version now held. An adapter push
        (LoRA) is served from the next call on as a new LoRA version; a full push replaces the
        base, and with it any adapter pushed for the old one."""
        adapter = wire_spec.get("adapter_config") is not None
        if adapter:
            self._lora_pushes += 1
            wire_spec = {**wire_spec, "adapter_dir": self._adapter_dir(self._lora_pushes)}
        timings = max(self.llm.collective_rpc("receive_weights", args=(wire_spec,)), key=lambda t: t["load_s"])
        if adapter:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(f"policy-{self._lora_pushes}", self._lora_pushes, wire_spec["adapter_dir"])
        else:
            self.lora_request = None
        # Cached prefixes were computed by the old weights: drop them or they leak into new samples.
        # (With requests running it does nothing; rollout.partial starts its engines without a
        # prefix cache.) Requests that run on keep their KV cache, computed by older weights:
        # each later token records the new version, and its own sampler log-prob.
        self.llm.reset_prefix_cache()
        self.policy_version = version
        self.llm.llm_engine.set_weight_version(str(version))
        return {"policy_version": version, **timings}

    def _adapter_dir(self, number: int) -> str:
        """Node-local tmpfs folder of adapter push `number`; the folders of older pushes go
        (the engine never asks for an adapter version again once a newer one is served)."""
        import shutil

        root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"grpo-lora-{os.getpid()}")
        if os.path.isdir(root):
            for old in os.listdir(root):
                if old != str(number - 1):
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        return os.path.join(root, str(number))



def engine_core_in_actor(setting: str, on_gpu: bool) -> bool:
    """rollout.engine_core resolved: `auto` keeps the engine core in the actor on CPUs only."""
    return not on_gpu if setting == "auto" else setting == "actor"


def lora_options(max_rank: int) -> dict:
    """vLLM's LoRA settings for engines that serve pushed adapters (one version at a time)."""
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1} if max_rank else {}


def sampling_is_seeded(setting, on_gpu: bool) -> bool:
    """rollout.seeded_sampling resolved. `auto` seeds each prompt, on GPUs too, unless vLLM is
    told to run its V1 model runner there (VLLM_USE_V2_MODEL_RUNNER=0): vLLM 0.32 runs Model
    Runner V2 on GPUs, whose sampler hashes a seed per request with each token's position (its
    Gumbel sampling) and gives an unseeded request a seed from numpy's global RNG, so an explicit seed costs only FlashInfer's fused top-k/top-p path, already off
    when processed log-probs are returned; V1 draws seeded requests one at a time."""
    if setting != "auto":
        return bool(setting)
    return not on_gpu or os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() not in ("0", "false")


def cpu_thread_binding(cpus: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks over `cpus`: contiguous shares, one per rank
    (`0,1|2,3`); with fewer CPUs than ranks, ranks share them round-robin (`0|1|0`)."""
    if len(cpus) < ranks:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))
    share, extra = divmod(len(cpus), ranks)
    parts, start = [], 0
    for rank in range(ranks):
        size = share + (rank < extra)
        parts.append(",".join(map(str, cpus[start:start + size])))
        start += size
    return "|".join(parts)


class StreamState:
    """The streaming requests an engine carries between `advance` calls."""
    def __init__(self) -> None:
        import itertools

        self.pending: Dict[str, Tuple[int, GenerationRequest, Any]] = {}  # request id -> (ticket, request, params)
        self.finished: List[Any] = []  # finished RequestOutputs not yet returned
        self.numbers = itertools.count()


def version_spans(completion, default: int) -> List[Tuple[int, int, int]]:
    """(version, start, end) of each span of a completion's tokens sampled by one weight
    version (vLLM's CompletionOutput.weight_versions); one span of `default` when vLLM has none."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return [(default, 0, len(completion.token_ids))]
    return [(int(s.version), s.start, s.end) for s in spans]


def _sampled_logprobs(completion) -> List[float]:
    """The sampler's log-prob of each token it chose (vLLM returns the chosen token's entry)."""
    return [float(step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs or [])]
