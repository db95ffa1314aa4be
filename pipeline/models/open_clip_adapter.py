"""``open_clip:<arch>[/<pretrained>]`` specs for ``models.clip``, behind the CLIP adapter's interface.

The model comes from open_clip's own factory (``open_clip.create_model_and_transforms(arch,
pretrained=...)``): ``<pretrained>`` is a local checkpoint file (``open_clip:ViT-B-16/ckpt/b16.bin``;
an absolute path after the slash: ``open_clip:ViT-B-16//data/b16.bin``) or an open_clip pretrained
tag already in the local cache (no hub is reached here). Without it the weights are random (seeded,
recorded ``random_weights: true`` and logged RANDOM WEIGHTS). Preprocessing is open_clip's eval
transform; text ids are open_clip's tokenizer's (``open_clip.get_tokenizer(arch)``; the character
offsets extract-clip-tokens stores come from its vocabulary in ``CLIPTokenizerFast``,
:mod:`pipeline.models.clip_bpe`).

:class:`OpenClip` gives what :mod:`pipeline.models.clip` reads from a Hugging Face ``CLIPModel``:
``config`` (vision ``image_size`` / ``patch_size`` / ``hidden_size``, text ``hidden_size``,
``projection_dim``) and, through :func:`encode_images` / :func:`encode_texts`, the same quantities:
patch tokens = the vision transformer's last block output without the class token (before
``ln_post``, as HF's ``last_hidden_state``), image embedding = pooled, ``ln_post``, projected; text
tokens = ``ln_final`` of the causal text transformer run on the caption's own tokens, text
embedding pooled at EOT and projected.
Supported: CLIP archs with a ViT image tower and open_clip's own text tower (ViT-B-16, ViT-B-32,
ViT-L-14, ...); others fail in one line naming the arch.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

PREFIX = "open_clip:"


def is_open_clip_spec(spec: str) -> bool:
    return spec.strip().lower().startswith(PREFIX)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``open_clip:ViT-B-16/ckpt.bin`` -> ("ViT-B-16", "ckpt.bin"); no slash: (arch, None)."""
    rest = spec.strip()[len(PREFIX):]
    arch, _, pretrained = rest.partition("/")
    if not arch:
        raise ValueError(f"{spec!r}: expected open_clip:<arch>[/<checkpoint file or pretrained tag>], e.g. open_clip:ViT-B-16")
    return arch, (pretrained or None)


def checkpoint_path(pretrained: str | None) -> Path | None:
    if pretrained is None:
        return None
    p = Path(pretrained).expanduser()
    return p if p.is_file() else None


class OpenClipProcessor:
    """open_clip's eval transform behind the ``processor(images=..., return_tensors="pt")`` call."""

    def __init__(self, transform, image_size: int):
        self.transform, self.image_size = transform, image_size

    def __call__(self, images, return_tensors: str = "pt"):
        return {"pixel_values": torch.stack([self.transform(im.convert("RGB")) for im in images])}


class OpenClipTokenizer:
    """``tokenizer(texts, padding=True, truncation=True, max_length=M, return_tensors="pt",
    return_offsets_mapping=...)`` as the adapter calls a Hugging Face tokenizer: ids from
    ``open_clip.get_tokenizer(arch)`` at context length M (truncated keeping EOT last), cut to the
    batch's longest; the attention mask covers SOT..EOT (open_clip pads with id 0, a real token)."""

    def __init__(self, arch: str):
        from pipeline.models.clip_bpe import open_clip_tokenizer

        self.arch = arch
        self.tok = open_clip_tokenizer(arch)
        self.eot = int(self.tok.eot_token_id)

    def __call__(self, texts, padding=True, truncation=True, max_length=None, return_tensors="pt",
                 return_offsets_mapping=False):
        texts = list(texts)
        ids = self.tok(texts, context_length=max_length or self.tok.context_length)
        lengths = (ids == self.eot).int().argmax(dim=1) + 1
        M = int(lengths.max()) if len(texts) else 0
        ids = ids[:, :M]
        mask = (torch.arange(M)[None, :] < lengths[:, None]).long()
        out = {"input_ids": ids, "attention_mask": mask}
        if return_offsets_mapping:
            out["offset_mapping"] = self._offsets(texts, ids, lengths)
        return out

    def _offsets(self, texts, ids, lengths) -> torch.Tensor:
        """Character spans of each token from the fast twin of the same vocabulary; SOT/EOT/padding
        (0, 0). Where the twin's ids differ from open_clip's (open_clip's ftfy/html clean changes the
        text), that text's spans are (0, 0): unknown rather than wrong."""
        from pipeline.models.clip_bpe import fast_clip_tokenizer

        fast = fast_clip_tokenizer(self.arch)
        enc = fast(texts, add_special_tokens=False, return_offsets_mapping=True)
        off = torch.zeros((*ids.shape, 2), dtype=torch.long)
        for i, (x, o) in enumerate(zip(enc["input_ids"], enc["offset_mapping"])):
            n = int(lengths[i]) - 2  # word tokens kept
            if n > 0 and ids[i, 1:n + 1].tolist() == list(x[:n]):
                off[i, 1:n + 1] = torch.as_tensor(o[:n], dtype=torch.long)
        return off


class OpenClip(torch.nn.Module):
    """An open_clip ``CLIP`` with the ``config`` the adapter reads (see the module doc)."""

    is_open_clip = True

    def __init__(self, model, arch: str):
        super().__init__()
        self.model, self.arch = model, arch
        from open_clip import CLIP
        from open_clip.transformer import VisionTransformer

        v = model.visual
        if not isinstance(model, CLIP) or not isinstance(v, VisionTransformer):
            raise ValueError(f"open_clip:{arch}: {type(model).__name__} with a {type(v).__name__} image tower is not "
                             "supported (a ViT image tower and open_clip's own text tower are needed: ViT-B-16, ViT-L-14, ...)")
        image_size, patch = int(v.image_size[0]), int(v.patch_size[0])
        proj_dim = int(v.proj.shape[1]) if v.proj is not None else int(v.transformer.width)
        self.config = SimpleNamespace(
            vision_config=SimpleNamespace(image_size=image_size, patch_size=patch, hidden_size=int(v.transformer.width),
                                          num_hidden_layers=len(v.transformer.resblocks)),
            text_config=SimpleNamespace(hidden_size=int(model.transformer.width),
                                        num_hidden_layers=len(model.transformer.resblocks)),
            projection_dim=proj_dim,
        )

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, project_tokens: bool = False) -> dict[str, torch.Tensor]:
        v = self.model.visual
        p = next(self.parameters())
        out = v.forward_intermediates(pixel_values.to(p.device, p.dtype), indices=1, output_fmt="NLC")
        patches = out["image_intermediates"][-1]  # last block, class token dropped, before ln_post
        if project_tokens:
            patches = v.ln_post(patches) @ v.proj
        return {"patch_tokens": patches, "image_embed": out["image_features"]}

    @torch.no_grad()
    def encode_texts(self, ids: torch.Tensor, mask: torch.Tensor, project_tokens: bool = False) -> dict[str, torch.Tensor]:
        """``ids`` [B, M] (SOT..EOT, zeros after), M <= the context length: open_clip's ``encode_text``
        on the first M positions (positional embeddings and causal mask cut to M: what the full
        context computes at every valid position, tested equal), pooled at EOT."""
        from open_clip.transformer import text_global_pool

        m = self.model
        M = ids.shape[1]
        ids = ids * mask  # zeros after EOT, as open_clip pads
        cast = m.transformer.get_cast_dtype()
        x = m.token_embedding(ids).to(cast) + m.positional_embedding[:M].to(cast)
        x = m.ln_final(m.transformer(x, attn_mask=m.attn_mask[:M, :M]))
        pooled = text_global_pool(x, ids, m.text_pool_type, eos_token_id=getattr(m, "text_eos_id", None))
        project = (lambda t: m.text_projection(t)) if isinstance(m.text_projection, torch.nn.Linear) else (lambda t: t @ m.text_projection)
        return {"text_tokens": project(x) if project_tokens else x, "text_embed": project(pooled)}


def load_open_clip(spec: str, seed: int):
    """``(OpenClip, processor, tokenizer, random_weights, checkpoint file or None)``."""
    import open_clip

    arch, pretrained = parse_spec(spec)
    if arch not in open_clip.list_models():
        import difflib

        close = difflib.get_close_matches(arch, open_clip.list_models(), n=1, cutoff=0.6)
        raise ValueError(f"{spec!r}: unknown open_clip arch {arch!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                         + f" (python -c 'import open_clip; print(open_clip.list_models())' lists the "
                           f"{len(open_clip.list_models())} archs)")
    ckpt = checkpoint_path(pretrained)
    if pretrained is not None and ckpt is None and pretrained not in open_clip.list_pretrained_tags_by_model(arch):
        raise ValueError(f"{spec!r}: {pretrained!r} is neither a checkpoint file nor an open_clip pretrained tag of {arch}")

    def build():
        return open_clip.create_model_and_transforms(arch, pretrained=str(ckpt) if ckpt else pretrained)

    if pretrained is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, _, preprocess = build()
    else:
        model, _, preprocess = build()
    wrapped = OpenClip(model, arch)
    proc = OpenClipProcessor(preprocess, wrapped.config.vision_config.image_size)
    return wrapped, proc, OpenClipTokenizer(arch), pretrained is None, ckpt
