"""The kvmesh client SDK: blocking ``KvmeshClient`` and asyncio ``AsyncKvmeshClient`` for the router's API.

    with KvmeshClient.from_state_dir() as client:
        for chunk in client.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)
        answer = client.complete(messages=[{"role": "user", "content": "Hi!"}])
        print(answer.text, answer.usage, answer.ttft_s)
"""

from kvmesh.client.aio import AsyncGenerateStream, AsyncKvmeshClient
from kvmesh.client.errors import (
                                  Cancelled,
                                  DeadlineExceeded,
                                  InvalidRequest,
                                  KvmeshError,
                                  Overloaded,
                                  Unauthenticated,
                                  Unavailable,
)
from kvmesh.client.requests import ChatOptions, Message, RequestOptions
from kvmesh.client.sync import GenerateStream, KvmeshClient
from kvmesh.client.types import (
                                  Completion,
                                  CompletionBuilder,
                                  GenerateChunk,
                                  HealthInfo,
                                  InstanceInfo,
                                  ModelInfo,
                                  ToolCall,
                                  Usage,
)
from kvmesh.contracts.engine import TokenLogprobs

__all__ = [
    "AsyncGenerateStream", "AsyncKvmeshClient", "Cancelled", "ChatOptions", "Completion", "CompletionBuilder",
    "DeadlineExceeded", "GenerateChunk", "GenerateStream", "HealthInfo", "InstanceInfo", "InvalidRequest",
    "KvmeshClient", "KvmeshError", "Message", "ModelInfo", "Overloaded", "RequestOptions", "TokenLogprobs",
    "ToolCall", "Unauthenticated", "Unavailable", "Usage",
]
