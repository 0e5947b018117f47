"""Workflows written with the installed `gpulane` package (clients/python), as a user
writes them; driven by test_client_python.py."""

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    import gpulane
    from gpulane import workflow as gw
    from gpulane.dataset import EmbedDatasetJob


@workflow.defn
class SessionSequence:
    """A first embed and `follow_ups` more pinned to its card, `pause_s` apart, inside
    `run_in_session`; the `progress` query says how far it got and where it is pinned."""

    def __init__(self) -> None:
        self.attempt = 0
        self.done = 0
        self.pinned = None

    @workflow.query
    def progress(self) -> dict:
        return {"attempt": self.attempt, "done": self.done, "pinned": self.pinned}

    @workflow.run
    async def run(self, follow_ups: int, pause_s: float, pinned_s: float) -> dict:
        async def body(session: gw.CardSession) -> list:
            self.attempt += 1
            self.done = 0
            queues = []
            for i in range(follow_ups + 1):
                out = await session.embed(gpulane.EmbedRequest(texts=[f"call {i}"]))
                assert isinstance(out, gpulane.EmbedResponse)
                queues.append(out.host_task_queue)
                self.done, self.pinned = i + 1, session.pinned_queue
                if pause_s:
                    await workflow.sleep(pause_s)
            return queues

        queues = await gw.run_in_session(
            body, pinned_schedule_to_start=timedelta(seconds=pinned_s),
            schedule_to_start=timedelta(seconds=30),
            # A kill that lands mid-call is noticed in 5 s, not the default 60 s.
            heartbeat_timeout=timedelta(seconds=5))
        return {"attempts": self.attempt, "queues": queues}


@workflow.defn
class FallbackEmbed:
    @workflow.run
    async def run(self, texts: list, budget_s: float) -> dict:
        started = workflow.now()
        out = await gw.embed(gpulane.EmbedRequest(texts=texts),
                             schedule_to_start=timedelta(seconds=budget_s))
        return {"device_kind": out.device.kind, "host_task_queue": out.host_task_queue,
                "waited_s": (workflow.now() - started).total_seconds()}


@workflow.defn
class TypedRoundTrip:
    """Returns what the typed results held, with their Python types, so the test sees both."""

    @workflow.run
    async def run(self, texts: list, query: str, documents: list) -> dict:
        e = await gw.embed(gpulane.EmbedRequest(texts=texts, model="minilm"))
        r = await gw.rerank(gpulane.RerankRequest(query=query, documents=documents,
                                                  model="ce", return_documents=True))
        return {
            "embed_type": type(e).__name__, "device_type": type(e.device).__name__,
            "usage_type": type(e.usage).__name__, "result_type": type(r.results[0]).__name__,
            "embeddings": e.embeddings, "model": e.model, "revision": e.revision,
            "dtype": e.dtype, "family": e.family, "dimensions": e.dimensions,
            "device_kind": e.device.kind, "host_task_queue": e.host_task_queue,
            "tokens": e.usage.tokens, "rerank_model": r.model,
            "results": [{"index": x.index, "score": x.score, "document": x.document}
                        for x in r.results],
        }


@workflow.defn
class BadInput:
    @workflow.run
    async def run(self, catch: bool) -> dict:
        request = gpulane.EmbedRequest(texts=[])
        if not catch:
            await gw.embed(request)
            return {}
        try:
            await gw.embed(request)
        except gpulane.InvalidInput as e:
            return {"class": type(e).__name__, "type": e.type,
                    "non_retryable": e.non_retryable, "message": e.message,
                    "is_gpulane_error": isinstance(e, gpulane.GpulaneError)}
        return {"class": None}


ALL = [SessionSequence, FallbackEmbed, TypedRoundTrip, BadInput, EmbedDatasetJob]
