"""Graph passes: a model's computation rewritten to need fewer bytes, then checked by running it.

Modules: ``onnx_passes`` (the passes on an ONNX ``ModelProto``, each measured and kept only
when it does not make the file larger), ``verify_onnx`` (original and output run by
onnxruntime on the same seeded inputs), ``onnx_slim`` (load, pass, write staged, verify,
commit: what :func:`modelsize.slim` calls for ONNX input). They need the ``onnx`` and
``onnxruntime`` packages (``pip install modelsize[onnx]``), imported only when used.
``tf_savedmodel`` does the same for TensorFlow SavedModels.
"""
