"""Several coroutines streaming from one engine at once."""

import asyncio

from pagedcore import AsyncLLMEngine, SamplingParams


async def ask(engine: AsyncLLMEngine, question: str) -> str:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=False)
    text = ""
    async for delta in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48)):
        text += delta.outputs[0].text
    return text


async def main() -> None:
    engine = AsyncLLMEngine.from_settings()
    try:
        answers = await asyncio.gather(*(ask(engine, q) for q in ["Hi!", "What is 2+2?", "Name a color."]))
        for a in answers:
            print("->", a)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
