"""Triton kernels used by the pools, each with a plain-torch reference.

Modules (imported on demand; importing :mod:`kvxfer.kernels` itself pulls in neither torch nor
Triton, so :mod:`kvxfer.kernels.errors` stays cheap):

* :mod:`kvxfer.kernels.dispatch`     backend selection ("auto" | "triton" | "torch"), ``force_backend``;
* :mod:`kvxfer.kernels.store`        K/V rows at token slots; masked store; prefix-valid store;
* :mod:`kvxfer.kernels.store_paged`  store into page-major 4-D strided views;
* :mod:`kvxfer.kernels.copy`         ``KvCopyTable``: move rows src -> tgt in all buffers, one launch;
* :mod:`kvxfer.kernels.mla`          MLA (nope, rope) store into one row and the inverse gather;
* :mod:`kvxfer.kernels.checksum`     per-item checksums over raw byte ranges (transfer integrity);
* :mod:`kvxfer.kernels.errors`       the exception hierarchy root;
* :mod:`kvxfer.kernels.cuda_driver`  the one CUDA driver layer (cuda-bindings, loaded on first
  use): pointer queries, legacy IPC, device copies, the VMM backing's driver. Torch-free; it
  lives here, like ``errors``, because every package may import downwards.

Every launcher copies raw bytes (any store dtype), checks shapes / strides / dtypes /
devices with typed errors, raises ``IndexOutOfRange`` for out-of-range indices on the
torch path and on CPU, and masks them off in-kernel on CUDA.
"""
