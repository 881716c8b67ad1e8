#!/usr/bin/env bash
# The main job: install what is missing, build, convert Fashion-MNIST to HDF5, train the
# Fashion-MNIST CNN on 4 local MPI ranks under plans/fashion_4ranks.yaml, print the test accuracy.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing
build
DATA="$ROOT/data/fashion-mnist"
"$BUILD/bin/tessera" convert fashion-mnist --output "$DATA"
RANKS="${TESSERA_RANKS:-4}"
# shellcheck disable=SC2046
mpirun -n "$RANKS" $(mpi_flags) "$BUILD/bin/tessera" train \
  --model "$ROOT/models/fashion_cnn.yaml" --plan "$ROOT/plans/fashion_${RANKS}ranks.yaml" \
  --data "$DATA/train.h5" --val-data "$DATA/test.h5" \
  --epochs "${TESSERA_EPOCHS:-10}" --batch 64 --optimizer sgd --lr 0.05 --momentum 0.9 --nesterov \
  --schedule cosine --warmup-steps 200 --seed 1 --progress-every 200 \
  --metrics-dir "$ROOT/runs/fashion_cnn" "$@"
