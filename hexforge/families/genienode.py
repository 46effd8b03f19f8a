"""What an encoder tower looks like as a node of a Genie pipeline (torch-free; the node graphs are
built by each encoder family's ``genie_node``, the bundle by forge/genie/towers.py).

A Genie pipeline (libGenie 1.21: ``GeniePipeline`` / ``GenieNode``) runs an encoder node whose
embeddings the text-generator node takes in prompt order (docs/genie-pipelines.md)::

    host: image / waveform ─preprocess (runtime/vision.py, audio.py)─▶ float32 arrays
      └─ GenieNode_setData(io, float32) ─▶ node graph (Genie quantizes each input to the graph's
         fixed-point encoding) ─▶ <output> rows ─accumulator─▶ text-generator inputs_embeds

Measured on libGenie 1.21 (x86 simulator), which is why a node graph differs from the bundle's
own tower graph:

  * a node input must be fixed point: a float32 graph input is refused ("Unsupported input
    tensor pixel_values dtype QNN_DATATYPE_FLOAT_32"), a float16 one is accepted and its data
    dropped (an echo graph read back zeros). So each float input is uint16 over a range the
    family knows ([0, 1] pixels; a log-mel bound), quantized by Genie from the host's float32;
    int32 inputs (Genie's own image_position_ids) and bool masks are taken as they are.
  * Genie computes some inputs itself from the node config (Gemma-4's image_position_ids and
    image_pooling_idx from ``vision-param``), so those are the node's inputs, not the host's.
  * the node's tensors are found by name: image_features out of an image node, input_features /
    input_features_mask (/ padded_mask_after_cnn) in and hidden_states out of an audio node; a
    row of the output is one row of the text-generator's inputs_embeds, so its width is the
    embedding LUT's. An audio node appends as many rows as its input_features_mask holds ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Genie's names for an encoder node's tensors (its QnnNspImageModel / QnnNspAudioModel look them up)
IMAGE_FEATURES = "image_features"
AUDIO_FEATURES = "hidden_states"
# the node IOs the host sets (GenieNode_IOName_t; runtime/genie/pipelinemodel.py has their values)
IMAGE_INPUT = "GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT"
AUDIO_INPUT = "GENIE_NODE_AUDIO_ENCODER_AUDIO_INPUT"
# our names for the two mask IOs libGenie 1.21 takes on an audio node (704: its tensor
# input_features_mask, whose ones Genie counts as the rows it appends; 702: padded_mask_after_cnn)
AUDIO_MASK = "GENIE_NODE_AUDIO_ENCODER_MASK_INPUT"
AUDIO_MASK_AFTER_CNN = "GENIE_NODE_AUDIO_ENCODER_MASK_AFTER_CNN_INPUT"


@dataclass(frozen=True)
class GenieNodeForm:
    """An encoder tower as a Genie pipeline node."""

    role: str  # Genie's node type: "image-encoder" | "audio-encoder"
    mode: str  # its engine's mode: "image" | "audio" (QnnNspImageModel / QnnNspAudioModel)
    module: object  # torch module with .io (Genie's tensor names) and .example_inputs()
    # float graph inputs made uint16 on [lo, hi] (Genie quantizes the host's float32 to them)
    fixed_point: dict[str, tuple[float, float]] = field(default_factory=dict)
    # {preprocessor output key: the node IO (GenieNode_IOName_t by name) the host sets it on}
    feeds: dict[str, str] = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # the node config's model keys beyond the binary
    # how its rows reach the text-generator: "node" (a pipeline connection: Genie appends them)
    # or "host" (the node's embedding callback, the host sets the prompt's n rows on the
    # generator's embedding input: an audio node's connection, measured, fails the execute)
    rows_via: str = "node"
