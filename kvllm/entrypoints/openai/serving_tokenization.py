"""POST /tokenize and /detokenize: the server's tokenizer and chat template, for clients that count tokens."""

from __future__ import annotations

from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvllm.entrypoints.openai.serving_engine import OpenAIServing, check_valid_unicode


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize a prompt (or chat messages) and detokenize token ids, as the model sees them."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        check_valid_unicode(request)
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Send exactly one of prompt or messages", param="prompt")
        if request.messages is not None:
            tokens = await self.in_tokenizer_thread(
                self.render_chat,
                request.messages,
                request.add_generation_prompt,
                request.chat_template_kwargs,
                None,
                request.tools,
                request.continue_final_message,
            )
        else:
            tokens = await self.in_tokenizer_thread(
                lambda: (
                    self.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids
                )
            )
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab_size = len(self.tokenizer)
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(
                f"Token id {bad} is out of range; allowed: 0 <= id < {vocab_size} (the tokenizer's vocabulary)",
                param="tokens",
            )
        text = await self.in_tokenizer_thread(self.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
