#!/usr/bin/env bash
# The edge-case requests a user of vLLM's server sends by mistake, against `kvllm serve` on the default model
# (SmolLM2-135M-Instruct, CPU): each should be refused with a 400 naming the field and what is allowed, or be
# served, and the server should keep serving (the last request). Starts the server on PORT (default 8011) with
# the hermes tool parser, waits until /v1/models answers, prints each reply's HTTP status and first 300
# characters, then stops the server; its log is in $LOG (default /tmp/serve_edge_cases.log).
#   bash benchmarks/serve_edge_cases.sh > docs/benchmarks/cpu/serve_edge_cases.txt
set -uo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8011}
LOG=${LOG:-/tmp/serve_edge_cases.log}
.venv/bin/kvllm serve --port "$PORT" --host 127.0.0.1 --max-model-len 1024 --enable-auto-tool-choice \
  --tool-call-parser hermes > "$LOG" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$reply"' EXIT
until curl -sf "localhost:$PORT/v1/models" > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "the server exited; see $LOG"; exit 1; }
  sleep 1
done
M=SmolLM2-135M-Instruct
reply=$(mktemp)
req() {  # label path body: the HTTP status, then the reply's first 300 characters
  local code
  code=$(curl -s -m 120 -o "$reply" -w '%{http_code}' -H 'Content-Type: application/json' "localhost:$PORT/$2" -d "$3")
  echo "== [$code] $1"
  head -c 300 "$reply"
  echo
}
req "max_tokens 0" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":0}"
req "max_tokens -1" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":-1}"
req "temperature -1" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"temperature\":-1}"
req "top_p 0" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"top_p\":0}"
req "top_k -5" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"top_k\":-5}"
req "n 0" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"n\":0}"
req "n 3 best_of 2" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"n\":3,\"best_of\":2}"
req "logprobs 100" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"logprobs\":100,\"max_tokens\":2}"
req "prompt too long" v1/completions "{\"model\":\"$M\",\"prompt\":\"$(python3 -c 'print("hello "*1200)')\",\"max_tokens\":2}"
req "prompt empty" v1/completions "{\"model\":\"$M\",\"prompt\":\"\",\"max_tokens\":2}"
req "prompt ids out of vocab" v1/completions "{\"model\":\"$M\",\"prompt\":[99999999],\"max_tokens\":2}"
req "prompt ids negative" v1/completions "{\"model\":\"$M\",\"prompt\":[-1, 5],\"max_tokens\":2}"
req "prompt list of lists" v1/completions "{\"model\":\"$M\",\"prompt\":[[1,2],[3,4]],\"max_tokens\":2}"
req "wrong model" v1/completions "{\"model\":\"nope\",\"prompt\":\"hi\",\"max_tokens\":2}"
req "stop 1000 strings" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":4,\"stop\":$(python3 -c 'import json;print(json.dumps([str(i) for i in range(1000)]))')}"
req "chat empty messages" v1/chat/completions "{\"model\":\"$M\",\"messages\":[],\"max_tokens\":2}"
req "chat bad role" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"wizard\",\"content\":\"hi\"}],\"max_tokens\":2}"
req "chat content null" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":null}],\"max_tokens\":2}"
req "chat content parts" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}],\"max_tokens\":2}"
req "chat image part" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x/y.png\"}}]}],\"max_tokens\":2}"
req "response_format bad schema" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"nonsense\"}}}}"
req "logit_bias bad" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"logit_bias\":{\"abc\":5}}"
req "logit_bias out of range" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"logit_bias\":{\"99999999\":5}}"
req "seed huge" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"seed\":99999999999999999999999}"
req "malformed json" v1/completions "{\"model\": "
req "top_logprobs 30" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,\"logprobs\":true,\"top_logprobs\":30}"
req "stream n=2" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":3,\"n\":2,\"stream\":true}"
req "max_tokens huge" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":100000}"
req "prompt_logprobs" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi there\",\"max_tokens\":1,\"prompt_logprobs\":2}"
req "echo+logprobs" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi there\",\"max_tokens\":1,\"echo\":true,\"logprobs\":1}"
req "tokenize" v1/tokenize "{\"model\":\"$M\",\"prompt\":\"hi there\"}"
req "detokenize bad" v1/detokenize "{\"model\":\"$M\",\"tokens\":[99999999]}"
req "embeddings on generate model" v1/embeddings "{\"model\":\"$M\",\"input\":\"hi\"}"
req "unknown field" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":1,\"frobnicate\":3}"
req "min_tokens > max_tokens" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":2,\"min_tokens\":5}"
req "presence_penalty 5" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":2,\"presence_penalty\":5}"
req "suffix" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":2,\"suffix\":\"x\"}"
req "root tokenize" tokenize "{\"model\":\"$M\",\"prompt\":\"hi there\"}"
req "root detokenize out of vocab" detokenize "{\"model\":\"$M\",\"tokens\":[99999999]}"
T='[{"type":"function","function":{"name":"get_weather","description":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]'
req "tools auto" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"weather in Paris?\"}],\"max_tokens\":20,\"tools\":$T}"
req "tool_choice required" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"weather in Paris?\"}],\"max_tokens\":60,\"tools\":$T,\"tool_choice\":\"required\"}"
req "tool_choice named missing" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":20,\"tools\":$T,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}}"
req "tools malformed" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":20,\"tools\":[{\"type\":\"function\"}]}"
req "tool_choice without tools" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":20,\"tool_choice\":\"required\"}"
req "n=3 json_object" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"json please\"}],\"max_tokens\":30,\"n\":3,\"temperature\":1,\"response_format\":{\"type\":\"json_object\"}}"
req "stream + json_schema" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":15,\"stream\":true,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}}}}"
req "regex structured_outputs completions" v1/completions "{\"model\":\"$M\",\"prompt\":\"phone:\",\"max_tokens\":20,\"structured_outputs\":{\"regex\":\"[0-9]{3}-[0-9]{4}\"}}"
req "bad regex" v1/completions "{\"model\":\"$M\",\"prompt\":\"phone:\",\"max_tokens\":20,\"structured_outputs\":{\"regex\":\"[0-9\"}}"
req "two constraints" v1/completions "{\"model\":\"$M\",\"prompt\":\"x\",\"max_tokens\":20,\"structured_outputs\":{\"regex\":\"a+\",\"choice\":[\"x\"]}}"
req "choice" v1/completions "{\"model\":\"$M\",\"prompt\":\"Pick:\",\"max_tokens\":20,\"structured_outputs\":{\"choice\":[\"yes\",\"no\"]}}"
req "stream logprobs" v1/completions "{\"model\":\"$M\",\"prompt\":\"hi\",\"max_tokens\":2,\"stream\":true,\"logprobs\":2}"
req "stop include" v1/completions "{\"model\":\"$M\",\"prompt\":\"The capital of France is\",\"max_tokens\":10,\"temperature\":0,\"stop\":[\"Paris\"],\"include_stop_str_in_output\":true}"
req "assistant prefill continue" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"},{\"role\":\"assistant\",\"content\":\"Hi there\"}],\"max_tokens\":5,\"continue_final_message\":true,\"add_generation_prompt\":false}"
req "continue + add_gen both" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"},{\"role\":\"assistant\",\"content\":\"Hi there\"}],\"max_tokens\":5,\"continue_final_message\":true}"
req "reasoning_effort" v1/chat/completions "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":3,\"reasoning_effort\":\"high\"}"
req "responses" v1/responses "{\"model\":\"$M\",\"input\":\"hi\",\"max_output_tokens\":5}"
req "responses tools" v1/responses "{\"model\":\"$M\",\"input\":\"hi\",\"max_output_tokens\":5,\"tools\":[{\"type\":\"web_search\"}]}"
req "still serving" v1/completions "{\"model\":\"$M\",\"prompt\":\"The capital of France is\",\"max_tokens\":5,\"temperature\":0}"
grep -h "fields were present" "$LOG"
