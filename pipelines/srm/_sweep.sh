#!/bin/bash
# TEMPORARY sweep driver (deleted after the sweep).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/msgspec-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
nproc; python3 -c 'import transformers, torch; print(transformers.__version__, torch.__version__)'
S=pipelines/srm/_sweep.py; BB=runs/srm3/backbone
run() { python3 $S run "$1" >> $OUT/results.jsonl 2>> $OUT/err_$(echo "$1" | sed 's/.*"name":"\([^"]*\)".*/\1/').log; }
( python3 $S backbone runs/bb8000 8000 >> $OUT/results.jsonl 2>$OUT/err_bb.log
  run '{"name":"B_base","backbone":"runs/bb8000"}' &
  run '{"name":"B_h16","backbone":"runs/bb8000","ppp":16,"hard":0.5}' &
  run '{"name":"B_h16_lm","backbone":"runs/bb8000","ppp":16,"hard":0.5,"lm_coef":1.0}' &
  wait ) &
python3 $S backbone $BB 3000 >> $OUT/results.jsonl 2>/dev/null &
run '{"name":"A_base","backbone":"'$BB'"}' &
run '{"name":"A_h16","backbone":"'$BB'","ppp":16,"hard":0.5}' &
run '{"name":"A_h16_lm","backbone":"'$BB'","ppp":16,"hard":0.5,"lm_coef":1.0}' &
run '{"name":"A_base_lm","backbone":"'$BB'","lm_coef":1.0}' &
run '{"name":"A_h16_b64","backbone":"'$BB'","ppp":16,"hard":0.5,"batch_size":64,"lr":1e-3}' &
run '{"name":"A_h16_lm_b64","backbone":"'$BB'","ppp":16,"hard":0.5,"batch_size":64,"lr":1e-3,"lm_coef":1.0}' &
run '{"name":"A_h16_lm_lr1e3","backbone":"'$BB'","ppp":16,"hard":0.5,"lr":1e-3,"lm_coef":1.0}' &
run '{"name":"A_h16_lm_16k","backbone":"'$BB'","ppp":16,"hard":0.5,"steps":14000,"lm_coef":1.0}' &
run '{"name":"A_h3_lm03","backbone":"'$BB'","ppp":16,"hard":0.3,"lm_coef":0.3}' &
run '{"name":"A_h16_lm_att","backbone":"'$BB'","ppp":16,"hard":0.5,"lm_coef":1.0,"pooling":"attention"}' &
run '{"name":"A_h16_4k","backbone":"'$BB'","ppp":16,"hard":0.5,"steps":4000,"lr":1e-3,"lm_coef":1.0}' &
wait
cat $OUT/results.jsonl
