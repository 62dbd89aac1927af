"""Vision towers from llama.cpp `mmproj` GGUFs: an image becomes the rows of embeddings a language
model takes in its place (ViT + projector as one compiled OpenVINO model, preprocessing in numpy
and Pillow as each family's Hugging Face image processor does it)."""
from vinoserve.model.vision.decode import decode_image
from vinoserve.model.vision.layout import image_token
from vinoserve.model.vision.model import PreparedImage, VisionModel, load_vision

__all__ = ["PreparedImage", "VisionModel", "decode_image", "image_token", "load_vision"]
