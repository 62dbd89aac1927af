"""Where an image's rows sit in the prompt: the text each family's Hugging Face processor puts
around them (Gemma3Processor's full_image_sequence, Idefics3Processor's replace_image_token;
LLaVA's processor puts none; Qwen-VL's chat template <|vision_start|> ... <|vision_end|>), as
text pieces to tokenize and runs of rows."""
from __future__ import annotations

_FAKE, _GLOBAL = "<fake_token_around_image>", "<global-img>"
_QWEN = ("<|vision_start|>", "<|vision_end|>")  # Qwen2-VL's chat template writes them around <|image_pad|>
_AROUND = {"mlp": ("", ""), "gemma3": ("\n\n<start_of_image>", "<end_of_image>\n\n"),
           "idefics3": (f"{_FAKE}{_GLOBAL}", _FAKE), "qwen2vl_merger": _QWEN, "qwen2.5vl_merger": _QWEN}
# The token each family's HF processor writes where image rows go (its image_token): the rows
# replace it, but the tokenizer splits the text around it, and a repetition penalty counts it, as HF's do.
_IMAGE_TOKEN = {"mlp": "<image>", "gemma3": "<image_soft_token>", "idefics3": "<image>",
                "qwen2vl_merger": "<|image_pad|>", "qwen2.5vl_merger": "<|image_pad|>"}


def image_token(projector: str) -> str:
    """The family's image token ("" for a projector without one)."""
    return _IMAGE_TOKEN.get(projector, "")


def image_layout(projector: str, rows_per_frame: int, grid: tuple[int, int]) -> list[str | int]:
    """Text pieces and row counts in prompt order; `grid`: idefics3's tiles (rows, cols), each
    a frame of `rows_per_frame` rows before the whole image's; (0, 0) for one frame (Qwen-VL:
    the image's own rows)."""
    parts: list[str | int] = []
    for r in range(grid[0]):
        for c in range(grid[1]):
            parts += [f"{_FAKE}<row_{r + 1}_col_{c + 1}>", rows_per_frame]
        parts.append("\n")
    before, after = _AROUND[projector]
    parts += ["\n" + before if grid[0] else before, rows_per_frame, after]
    return _merged(parts)


def _merged(parts: list[str | int]) -> list[str | int]:
    """Adjacent text pieces joined (the tokenizer sees them as one), empty ones dropped."""
    out: list[str | int] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return out
