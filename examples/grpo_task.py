"""A task for online RL small enough for a laptop's CPU: a tiny Llama (random weights), a
tokenizer trained here, prompts that ask for a digit back ("Say 7:"), and the reward that checks
it. Writes DIR/model (a Hugging Face model directory), DIR/prompts.jsonl (TRL's prompt-only
records, with the answer as a column the reward reads) and DIR/reward.py (TRL's signature).

    python examples/grpo_task.py runs/grpo-task
"""

import json
import sys
from pathlib import Path

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/grpo-task")
model_dir = out / "model"
model_dir.mkdir(parents=True, exist_ok=True)
texts = [f"Say {d}: {d}" for d in range(10)] * 20
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(str(model_dir / "tokenizer.json"))
(model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
torch.manual_seed(0)
config = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
tf.LlamaForCausalLM(config).save_pretrained(model_dir)
(out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {d}:", "answer": str(d)}) + "\n"
                                           for d in range(10)))
(out / "reward.py").write_text('''
def says_it(completions, answer, **kwargs):
    """1 where the completion's first word is the digit asked for, 0.5 where it holds it elsewhere."""
    out = []
    for text, digit in zip(completions, answer):
        words = text.split()
        out.append(1.0 if words and words[0] == digit else 0.5 if digit in text else 0.0)
    return out
''')
print(f"wrote {model_dir}, {out / 'prompts.jsonl'} and {out / 'reward.py'}")
