"""An `optimum-cli export openvino --task image-text-to-text` directory's language model as
vinoserve's own shape: the export splits it into a text-embeddings model (input_ids -> rows, the
family's embedding scale inside) and a stateful language model taking inputs_embeds. Splicing the
first into the second in place of its inputs_embeds gives an ordinary stateful input_ids graph, so
the PagedAttention transformation, image_inputs.py's scatter (after the scale, found from the
Gather of input_ids as in any export), the decode compilations and prefix caching apply unchanged.
The export's vision side is model/vision/export.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.errors import ModelLoadError, last_line
from vinoserve.model.image_attention import TOKEN_TYPES
from vinoserve.model.spec import read_json
from vinoserve.model.vision.export import PROJECTORS

LANGUAGE_XML = "openvino_language_model.xml"
EMBEDDINGS_XML = "openvino_text_embeddings_model.xml"
INPUT_IDS = "input_ids"
_EMBEDS = "inputs_embeds"


def weight_files(path: Path) -> tuple[Path, ...]:
    """The files the spliced language model's weights are read from (mapped by read_model)."""
    return tuple(path / Path(name).with_suffix(".bin") for name in (LANGUAGE_XML, EMBEDDINGS_XML))


def is_vlm_export(path: Path) -> bool:
    """A directory holding an image-text-to-text export's language and text-embeddings models."""
    return (path / LANGUAGE_XML).is_file() and (path / EMBEDDINGS_XML).is_file()


def check_family(path: Path) -> None:
    """ModelLoadError, before anything is compiled, for an export of a family vinoserve does not
    serve from IR (one line, saying what does work)."""
    model_type = str(read_json(path / "config.json", required=True).get("model_type", ""))
    if model_type not in PROJECTORS:
        raise ModelLoadError(f"{path}: image-text-to-text exports of {model_type or 'an unnamed model_type'} are not "
                             f"served (from IR: {', '.join(PROJECTORS)})")


def read_language_model(core: ov.Core, path: Path) -> ov.Model:
    """The export's language model with its text embeddings spliced in (input_ids in)."""
    models = []
    for name in (LANGUAGE_XML, EMBEDDINGS_XML):
        try:
            models.append(core.read_model(path / name))
        except RuntimeError as e:
            raise ModelLoadError(f"{path}/{name} cannot be read (truncated or corrupt?): {last_line(e)}") from e
    return splice_embeddings(*models, where=path)


def splice_embeddings(language: ov.Model, embeddings: ov.Model, where: Path | str = "the export") -> ov.Model:
    """In place on `language`: its inputs_embeds parameter replaced by `embeddings`' graph, whose
    token-ids parameter becomes `language`'s input_ids."""
    embeds = _parameter(language, _EMBEDS, where, LANGUAGE_XML)
    ids_params, results = embeddings.get_parameters(), embeddings.get_results()
    if len(ids_params) != 1 or len(results) != 1:
        raise ModelLoadError(f"{where}: {EMBEDDINGS_XML} has {len(ids_params)} inputs and {len(results)} outputs; "
                             "one of each (token ids -> embeddings) expected")
    rows = results[0].input_value(0)
    if rows.get_partial_shape()[-1] != embeds.get_partial_shape()[-1]:
        raise ModelLoadError(f"{where}: the text embeddings are {rows.get_partial_shape()[-1]} wide, the language "
                             f"model takes {embeds.get_partial_shape()[-1]}: the two models are of different exports")
    if rows.get_element_type() != embeds.get_element_type():
        raise ModelLoadError(f"{where}: the text embeddings are {rows.get_element_type()}, the language model "
                             f"takes {embeds.get_element_type()}")
    ids = ids_params[0]
    ids.set_friendly_name(INPUT_IDS)
    ids.output(0).set_names({INPUT_IDS})
    for target in list(embeds.output(0).get_target_inputs()):
        target.replace_source_output(rows)
    language.remove_parameter(embeds)
    language.add_parameters([ids])
    _drop_token_types(language, ids)
    language.validate_nodes_and_infer_types()
    return language


def _drop_token_types(language: ov.Model, ids: ov.Node) -> None:
    """Gemma 3's export takes token_type_ids for its attention mask's image blocks; the mask is
    PagedAttention's to make (model/image_attention.py gives the kernel its own token_type_ids),
    so the export's input becomes zeros shaped as input_ids and leaves the graph's inputs."""
    types = next((p for p in language.get_parameters() if TOKEN_TYPES in p.output(0).get_names()), None)
    if types is None:
        return
    zeros = ops.broadcast(ops.constant(np.zeros((), types.get_element_type().to_dtype())), ops.shape_of(ids))
    for target in list(types.output(0).get_target_inputs()):
        target.replace_source_output(zeros.output(0))
    language.remove_parameter(types)


def _parameter(model: ov.Model, name: str, where: Path | str, file: str) -> ov.Node:
    found = next((p for p in model.get_parameters() if name in p.output(0).get_names()), None)
    if found is None:
        raise ModelLoadError(f"{where}: {file} takes no {name} (not an image-text-to-text export's language model)")
    return found
