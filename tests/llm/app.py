#!/usr/bin/env python3
"""One application of the token-accounting tests (tests/llm_usage.rs): the real `openai` and
`anthropic` SDKs (and plain httpx2 for Gemini, which the issue names no SDK for) calling the
sidecar, either on its route listeners (base URLs given) or over its Unix socket (`--uds`: the
base URLs then name the API hosts, which the sidecar routes by `Host`).

`--plan` is a JSON list of calls, each {"id", "kind", "model"}; kind is one of chat_json,
chat_stream (with stream_options.include_usage), chat_stream_no_usage, responses_json,
responses_stream, messages_json, messages_stream (the SDK's stream helper), gemini_json,
gemini_stream (alt=sse). Each call carries `x-test-id: <id>`, and `x-egress-app: <app>` on every
request when `--app` is given (the SDKs' default_headers).

Prints one JSON line per call: {"id", "status", "sha256", "bytes", "model", "spend"}, where
sha256 and bytes are of the raw body bytes the app received (hashed in the transport, under the
SDK's parsing), model is the answer's model as the SDK parsed it, and spend is the usage the SDK
parsed, in the sidecar's terms (input, output, cache_read, cache_write, reasoning; None for a
stream without usage).
"""

import argparse
import hashlib
import json
import sys

import anthropic
import httpx2
import openai


class Hashed(httpx2.SyncByteStream):
    """A response body stream that hashes the bytes as the SDK reads them."""

    def __init__(self, inner, record):
        self.inner = inner
        self.record = record

    def __iter__(self):
        for chunk in self.inner:
            self.record["hash"].update(chunk)
            self.record["bytes"] += len(chunk)
            yield chunk

    def close(self):
        self.inner.close()


class HashingTransport(httpx2.HTTPTransport):
    """The SDKs' transport: records each answer's raw body bytes by the request's x-test-id."""

    def __init__(self, records, **kwargs):
        super().__init__(**kwargs)
        self.records = records

    def handle_request(self, request):
        response = super().handle_request(request)
        record = {"hash": hashlib.sha256(), "bytes": 0, "status": response.status_code}
        self.records[request.headers.get("x-test-id", "")] = record
        response.stream = Hashed(response.stream, record)
        return response


def openai_spend(usage):
    if usage is None:
        return None
    if hasattr(usage, "prompt_tokens"):
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        reasoning = (
            usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
        )
        return {
            "input": usage.prompt_tokens,
            "output": usage.completion_tokens,
            "cache_read": cached or 0,
            "cache_write": 0,
            "reasoning": reasoning or 0,
        }
    return {
        "input": usage.input_tokens,
        "output": usage.output_tokens,
        "cache_read": usage.input_tokens_details.cached_tokens,
        "cache_write": 0,
        "reasoning": usage.output_tokens_details.reasoning_tokens,
    }


def anthropic_spend(usage):
    read = usage.cache_read_input_tokens or 0
    write = usage.cache_creation_input_tokens or 0
    return {
        "input": usage.input_tokens + read + write,
        "output": usage.output_tokens,
        "cache_read": read,
        "cache_write": write,
        "reasoning": 0,
    }


def gemini_spend(meta):
    thoughts = meta.get("thoughtsTokenCount", 0)
    return {
        "input": meta["promptTokenCount"],
        "output": meta["candidatesTokenCount"] + thoughts,
        "cache_read": meta.get("cachedContentTokenCount", 0),
        "cache_write": 0,
        "reasoning": thoughts,
    }


MESSAGES = [{"role": "user", "content": "What do tokens cost?"}]


def call(kind, model, extra, oai, ant, gem):
    """Makes one call; returns (model, spend) as the SDK (or the SSE lines) gave them."""
    if kind == "chat_json":
        r = oai.chat.completions.create(model=model, messages=MESSAGES, extra_headers=extra)
        return r.model, openai_spend(r.usage)
    if kind in ("chat_stream", "chat_stream_no_usage"):
        options = {"include_usage": True} if kind == "chat_stream" else openai.NOT_GIVEN
        stream = oai.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, stream_options=options, extra_headers=extra
        )
        seen_model, usage = None, None
        for chunk in stream:
            seen_model = chunk.model
            if chunk.usage is not None:
                usage = chunk.usage
        return seen_model, openai_spend(usage)
    if kind == "responses_json":
        r = oai.responses.create(model=model, input="What do tokens cost?", extra_headers=extra)
        return r.model, openai_spend(r.usage)
    if kind == "responses_stream":
        stream = oai.responses.create(
            model=model, input="What do tokens cost?", stream=True, extra_headers=extra
        )
        done = None
        for event in stream:
            if event.type == "response.completed":
                done = event.response
        return done.model, openai_spend(done.usage)
    if kind == "messages_json":
        r = ant.messages.create(model=model, max_tokens=256, messages=MESSAGES, extra_headers=extra)
        return r.model, anthropic_spend(r.usage)
    if kind == "messages_stream":
        with ant.messages.stream(
            model=model, max_tokens=256, messages=MESSAGES, extra_headers=extra
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
        return final.model, anthropic_spend(final.usage)
    if kind in ("gemini_json", "gemini_stream"):
        body = {"contents": [{"role": "user", "parts": [{"text": "What do tokens cost?"}]}]}
        headers = dict(extra, **{"x-goog-api-key": "gemini-test-key"})
        if kind == "gemini_json":
            r = gem.post("/v1beta/models/%s:generateContent" % model, json=body, headers=headers)
            r.raise_for_status()
            doc = r.json()
            return doc["modelVersion"], gemini_spend(doc["usageMetadata"])
        path = "/v1beta/models/%s:streamGenerateContent?alt=sse" % model
        last = None
        with gem.stream("POST", path, json=body, headers=headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[len("data: ") :])
        return last["modelVersion"], gemini_spend(last["usageMetadata"])
    raise ValueError("unknown kind %r" % kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--openai", required=True, help="OpenAI base URL (ending in /v1)")
    ap.add_argument("--anthropic", required=True, help="Anthropic base URL")
    ap.add_argument("--gemini", required=True, help="Gemini base URL")
    ap.add_argument("--uds", help="the sidecar's Unix socket; else TCP to the base URLs")
    ap.add_argument("--app", help="sent as x-egress-app on every request")
    ap.add_argument("--plan", required=True, help="JSON list of {id, kind, model}")
    args = ap.parse_args()

    records = {}

    def client():
        transport = HashingTransport(records, uds=args.uds) if args.uds else HashingTransport(records)
        # Only the transport named here, never a proxy from the environment.
        return httpx2.Client(transport=transport, trust_env=False, timeout=30.0)

    headers = {"x-egress-app": args.app} if args.app else {}
    oai = openai.OpenAI(
        api_key="sk-test", base_url=args.openai, default_headers=headers, http_client=client(), max_retries=0
    )
    ant = anthropic.Anthropic(
        api_key="sk-ant-test",
        base_url=args.anthropic,
        default_headers=headers,
        http_client=client(),
        max_retries=0,
    )
    gem = httpx2.Client(
        base_url=args.gemini,
        headers=headers,
        transport=HashingTransport(records, uds=args.uds) if args.uds else HashingTransport(records),
        trust_env=False,
        timeout=30.0,
    )
    for step in json.loads(args.plan):
        extra = {"x-test-id": step["id"]}
        model, spend = call(step["kind"], step["model"], extra, oai, ant, gem)
        record = records[step["id"]]
        line = {
            "id": step["id"],
            "status": record["status"],
            "sha256": record["hash"].hexdigest(),
            "bytes": record["bytes"],
            "model": model,
            "spend": spend,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
