"""Triton kernels used by the pools, each with a plain-torch reference.

Modules (imported on demand; importing :mod:`kernels` itself pulls in neither torch nor
Triton, so :mod:`kernels.errors` stays cheap):

* :mod:`kernels.dispatch`     backend selection ("auto" | "triton" | "torch"), ``force_backend``;
* :mod:`kernels.store`        K/V rows at token slots; masked store; prefix-valid store;
* :mod:`kernels.store_paged`  store into page-major 4-D strided views;
* :mod:`kernels.copy`         ``KvCopyTable``: move rows src -> tgt in all buffers, one launch;
* :mod:`kernels.mla`          MLA (nope, rope) store into one row and the inverse gather;
* :mod:`kernels.checksum`     per-item checksums over raw byte ranges (transfer integrity);
* :mod:`kernels.errors`       the exception hierarchy root.

Every launcher copies raw bytes (any store dtype), checks shapes / strides / dtypes /
devices with typed errors, raises ``IndexOutOfRange`` for out-of-range indices on the
torch path and on CPU, and masks them off in-kernel on CUDA.
"""
