"""200 concurrent streaming requests all complete with the expected token counts; the KV cache empties."""

import asyncio

import openai


def test_200_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None]:
        stream = await client.completions.create(
            model="tiny", prompt=f"request {i}", max_tokens=8 + i % 5, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, reason, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage
        return usage.completion_tokens, text, reason

    async def main():
        limits = openai.DefaultAsyncHttpxClient(limits=__import__("httpx").Limits(max_connections=250))
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=300,
                                      http_client=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(main())
    assert [tokens for tokens, _, _ in results] == [8 + i % 5 for i in range(200)]
    assert all(reason == "length" for _, _, reason in results)
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert m["ninefold:num_requests_running"] == 0 and m["ninefold:num_requests_waiting"] == 0
    assert m["ninefold:time_to_first_token_seconds_count"] >= 200
    assert m["ninefold:e2e_request_latency_seconds_count"] >= 200
