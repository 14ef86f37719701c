"""Time one tool-call round trip on a running `spark serve` (docs/measurements.md's figure).

python scripts/agent_round_trip.py http://127.0.0.1:8080/v1 [KEY]
"""

from __future__ import annotations

import json
import sys
import time

import openai

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


def main() -> None:
    c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2] if len(sys.argv) > 2 else "none")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    t0 = time.perf_counter()
    r = c.chat.completions.create(model="spark", messages=msgs, tools=[TOOL], tool_choice="required", temperature=0)
    t1 = time.perf_counter()
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = c.chat.completions.create(model="spark", messages=msgs, tools=[TOOL], temperature=0, max_tokens=16)
    t2 = time.perf_counter()
    print(json.dumps({"call": call.function.name, "arguments": json.loads(call.function.arguments),
                      "call_seconds": round(t1 - t0, 2), "call_tokens": r.usage.completion_tokens,
                      "answer_seconds": round(t2 - t1, 2), "answer_tokens": r2.usage.completion_tokens,
                      "round_trip_seconds": round(t2 - t0, 2)}))


if __name__ == "__main__":
    main()
