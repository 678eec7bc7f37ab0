# shellcheck shell=bash
# common.sh — shared by pretrain_deepspeed.sbatch and pretrain_megatron.sbatch (source it; do not run it).
#
# What a shardsafe job does inside its allocation (docs/slurm.md):
#   1. record the allocation (SLURM_RESTART_COUNT: requeue-safe), clear stale completion markers; name the
#      run (SS_RUN_NAME: the persistent tier's directory, the same for every requeue and resubmission);
#   2. start the job controller on the batch host: it serves torch elastic's c10d rendezvous and
#      writes the launcher's TOR events (RUN_DIR/events.jsonl);
#   3. start one holder per node of the allocation, spares included, each its own step:
#      `srun --overlap --no-kill -N1 -n1 -w NODE` (--overlap: the training steps may share the node;
#      one step per node: a lost node kills only its own holder);
#   4. start one torchrun agent per active node, each its own step (shardsafe agent = torchrun plus
#      job-wide attempt numbers); torch elastic restarts failed workers inside the allocation, and
#      the holders, not being part of any worker group, keep their memory;
#   5. watch: every rank's completion marker (srun's exit code proves nothing for a rank whose node
#      crashed); the live node list from `scontrol show job` (the SLURM_* node variables are stale
#      after a node loss); a lost node is reported to the controller and replaced by a spare, whose
#      agent joins torch elastic's next round; with no spare left, after SS_SHRINK_AFTER_S the job is
#      re-formed on the nodes left at the largest data-parallel size that keeps the global batch
#      (`shardsafe control shrink-plan`): its agents are stopped and new ones start in a rendezvous of
#      fewer nodes (docs/operations.md "Continuing on fewer nodes");
#   6. end: job_end to the controller, stop holders; optionally requeue a failed job.
#
# Every knob is an environment variable SS_*, documented with its default in the sbatch headers.

ss_log() { echo "[shardsafe $(date +%T.%3N)] $*" >&2; }
ss_die() { ss_log "ERROR: $*"; exit 2; }

# ---- knobs ----------------------------------------------------------------------------------------------
ss_defaults() {
  ss_run_name
  : "${SS_REPO:=${SLURM_SUBMIT_DIR:-$PWD}}"
  : "${SS_PYTHON:=$(command -v python3 || command -v python)}"
  : "${SS_SPARES:=1}"
  : "${SS_NODES:=$(( ${SLURM_JOB_NUM_NODES:-1} - SS_SPARES ))}"
  : "${SS_NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
  : "${SS_RUN_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/runs/${SLURM_JOB_ID}}"
  : "${SS_JOB_ID:=${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}}"
  : "${SS_HOLDER_DIR:=}"
  : "${SS_MEMORY_BUDGET_GB:=0}"
  : "${SS_MAX_RESTARTS:=3}"
  : "${SS_RESTART:=${SHARDSAFE_RESTART:-full}}"
  : "${SS_HANG_TIMEOUT:=600}"
  : "${SS_SHRINK_AFTER_S:=180}"
  : "${SS_MODEL_PARALLEL:=1}"
  : "${SS_GLOBAL_BATCH:=0}"
  : "${SS_MICRO_BATCH:=0}"
  : "${SS_INJECT:=}"
  : "${SS_RDZV_PORT:=$(( 29400 + ${SLURM_JOB_ID:-0} % 1000 ))}"
  : "${SS_KEEP_ALIVE_S:=5}"
  : "${SS_KEEP_ALIVE_MISSES:=3}"
  : "${SS_JOIN_TIMEOUT:=900}"
  : "${SS_GRACE:=3}"
  : "${SS_POLL_S:=1}"
  : "${SS_USE_NODE_ADDR:=1}"
  : "${SS_SRUN_ARGS:=}"
  : "${SS_HOLDER_SRUN_ARGS:=}"
  : "${SS_TORCHRUN_ARGS:=}"
  : "${SS_PRELOAD:=}"
  : "${SS_READY_TIMEOUT:=120}"
  : "${SS_HOLDER_STOP_TIMEOUT:=130}"
  : "${SS_REQUEUE_ON_FAILURE:=0}"
  : "${SS_MAX_REQUEUES:=1}"
  : "${SS_DRY_RUN:=0}"
  [ "$SS_NODES" -ge 1 ] 2>/dev/null || ss_die "SS_NODES=$SS_NODES: need >= 1 active node (allocated ${SLURM_JOB_NUM_NODES:-?}, SS_SPARES=$SS_SPARES)"
  [ "$SS_RESTART" = full ] || [ "$SS_RESTART" = in-place ] ||
    ss_die "SS_RESTART=$SS_RESTART: expected full or in-place (in-place: the training script runs inside shardsafe.inplace.run)"
  [ -n "$SS_PYTHON" ] || ss_die "no python found: set SS_PYTHON to the interpreter that has shardsafe installed"
  [[ $SS_SHRINK_AFTER_S =~ ^[0-9]+(\.[0-9]*)?$ ]] || ss_die "SS_SHRINK_AFTER_S=$SS_SHRINK_AFTER_S: expected seconds >= 0 (0 = never shrink)"
  [ "${SS_SHRINK_AFTER_S%.*}" = 0 ] || [ "${SS_SHRINK_AFTER_S%.*}" -lt "$SS_JOIN_TIMEOUT" ] ||
    ss_die "SS_SHRINK_AFTER_S=$SS_SHRINK_AFTER_S must be below SS_JOIN_TIMEOUT=$SS_JOIN_TIMEOUT: the agents waiting for a lost node's place give up after it, before the job could shrink"
}

# The run's name keys the persistent tier (PERSIST_DIR/RUN_NAME, shardsafe.run_name), which must outlive the
# job id: SS_JOB_ID changes with every requeue (SLURM_RESTART_COUNT) and resubmission (SLURM_JOB_ID) and scopes
# only what lives in memory. Default, first that is set: SS_RUN_NAME; the last component of an SS_RUN_DIR you
# chose (a resubmission names the same directory); the job name (sbatch --job-name, the script's #SBATCH line),
# plus _TASKID for an array task. Derived names are made file-name safe; a name you set must already be.
ss_run_name() {
  if [ -n "${SS_RUN_NAME:-}" ]; then
    [[ $SS_RUN_NAME =~ ^[A-Za-z0-9._-]{1,64}$ && $SS_RUN_NAME =~ [^.] ]] ||
      ss_die "SS_RUN_NAME=$SS_RUN_NAME: expected 1-64 of the characters A-Z a-z 0-9 . _ - (not only dots); it names the run's directory under persist_dir"
    return 0
  fi
  if [ -n "${SS_RUN_DIR:-}" ]; then
    SS_RUN_NAME=$(basename "$(realpath -m "$SS_RUN_DIR")")
  else
    SS_RUN_NAME=${SLURM_JOB_NAME:-shardsafe}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
  fi
  SS_RUN_NAME=$(printf '%s' "$SS_RUN_NAME" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-64)
  [[ $SS_RUN_NAME =~ [^.] ]] || SS_RUN_NAME=shardsafe
}

# ---- SLURM queries ---------------------------------------------------------------------------------------
# Nodes the job holds *now* (after a node loss the SLURM_JOB_NODELIST variable is stale).
ss_live_nodes() {
  local list
  list=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o ' NodeList=[^ ]*' | head -1 | cut -d= -f2)
  [ -n "$list" ] && [ "$list" != "(null)" ] && scontrol show hostnames "$list"
}

# Where other nodes reach NODE: NodeAddr (node names need not resolve), else the name.
ss_node_addr() {
  local addr=""
  [ "$SS_USE_NODE_ADDR" = 1 ] && addr=$(scontrol show node -o "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  echo "${addr:-$1}"
}

ss_run() {  # run or, with SS_DRY_RUN=1, print
  if [ "$SS_DRY_RUN" = 1 ]; then echo "DRY-RUN: $*"; else "$@"; fi
}

# ---- 1. setup -------------------------------------------------------------------------------------------
ss_setup() {
  ss_defaults
  SS_T0=$(date +%s.%N)
  mkdir -p "$SS_RUN_DIR"/{logs,markers,control}
  # Requeue-safe: the run directory survives a requeue (same SLURM_JOB_ID); markers and notifications of
  # an earlier allocation must not count, its events stay (the controller continues their attempt numbers).
  rm -f "$SS_RUN_DIR"/markers/*.done "$SS_RUN_DIR"/control/*.json "$SS_RUN_DIR"/control/ready
  echo "$(date -Is) job=$SLURM_JOB_ID restart_count=${SLURM_RESTART_COUNT:-0} run_name=$SS_RUN_NAME nodes=${SLURM_JOB_NODELIST:-?} batch_host=${SLURMD_NODENAME:-?}" \
    >> "$SS_RUN_DIR/slurm_allocations.log"
  mapfile -t SS_ALL_NODES < <(ss_live_nodes)
  [ "${#SS_ALL_NODES[@]}" -ge 1 ] || ss_die "cannot read the job's node list (scontrol show job $SLURM_JOB_ID)"
  [ "${#SS_ALL_NODES[@]}" -ge "$SS_NODES" ] || ss_die "SS_NODES=$SS_NODES active nodes but the job holds ${#SS_ALL_NODES[@]}: ${SS_ALL_NODES[*]}"
  # The batch host runs the controller and cannot be covered by a spare: make it an active node.
  local batch=${SLURMD_NODENAME:-${SS_ALL_NODES[0]}} n
  SS_ACTIVE=("$batch"); SS_SPARE_NODES=()
  for n in "${SS_ALL_NODES[@]}"; do
    [ "$n" = "$batch" ] && continue
    if [ "${#SS_ACTIVE[@]}" -lt "$SS_NODES" ]; then SS_ACTIVE+=("$n"); else SS_SPARE_NODES+=("$n"); fi
  done
  SS_WORLD=$(( SS_NODES * SS_NPROC_PER_NODE )); SS_FULL_WORLD=$SS_WORLD
  SS_RUN_NODES=$SS_NODES; SS_DP=$(( SS_WORLD / SS_MODEL_PARALLEL )); SS_GEN=0; SS_SHRINK_AT=""
  SS_CONTROL="$(ss_node_addr "$batch"):$SS_RDZV_PORT"
  export SHARDSAFE_RUN_DIR="$SS_RUN_DIR" SHARDSAFE_JOB_ID="$SS_JOB_ID" SHARDSAFE_RUN_NAME="$SS_RUN_NAME" \
    SHARDSAFE_JOB_START_T="$SS_T0" SHARDSAFE_RESTART="$SS_RESTART"
  [ -n "$SS_HOLDER_DIR" ] && export SHARDSAFE_HOLDER_DIR="$SS_HOLDER_DIR"
  export PYTHONPATH="$SS_REPO${PYTHONPATH:+:$PYTHONPATH}"
  declare -gA SS_HOLDER_PID=() SS_AGENT_PID=() SS_LOST=()
  ss_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): active ${SS_ACTIVE[*]}; spares ${SS_SPARE_NODES[*]:-none};" \
         "$SS_WORLD ranks; run dir $SS_RUN_DIR; run name $SS_RUN_NAME; job id $SS_JOB_ID; controller $SS_CONTROL"
}

# ---- 2. controller --------------------------------------------------------------------------------------
ss_start_controller() {
  ss_run "$SS_PYTHON" -m shardsafe.launch control serve --run-dir "$SS_RUN_DIR" --listen "$SS_CONTROL" \
    --job-id "$SS_JOB_ID" --world-size "$SS_WORLD" --max-restarts "$SS_MAX_RESTARTS" --hang-timeout-s "$SS_HANG_TIMEOUT" \
    --grace-s "$SS_GRACE" --job-start-t "$SS_T0" --requeue-count "${SLURM_RESTART_COUNT:-0}" \
    >> "$SS_RUN_DIR/logs/controller.log" 2>&1 &
  SS_CONTROLLER_PID=$!
  [ "$SS_DRY_RUN" = 1 ] && return 0
  ss_wait_for "controller" "test -f '$SS_RUN_DIR/control/ready'" || ss_die "the controller did not start; see $SS_RUN_DIR/logs/controller.log"
}

ss_wait_for() {  # ss_wait_for WHAT CONDITION
  local i
  for ((i = 0; i < SS_READY_TIMEOUT * 10; i++)); do
    eval "$2" && return 0
    sleep 0.1
  done
  ss_log "$1 not ready after ${SS_READY_TIMEOUT}s"; return 1
}

# ---- 3. holders -----------------------------------------------------------------------------------------
ss_start_holder() {
  local node=$1 log="$SS_RUN_DIR/logs/holder_$1.log"
  # shellcheck disable=SC2086
  ss_run srun --overlap --no-kill -N1 -n1 -w "$node" --kill-on-bad-exit=0 --job-name="ss-holder-$node" \
    --output="$log" $SS_HOLDER_SRUN_ARGS \
    "$SS_PYTHON" -m shardsafe.cli holder --job-id "$SS_JOB_ID" --node "$node" ${SS_HOLDER_DIR:+--holder-dir "$SS_HOLDER_DIR"} \
    --memory-budget-gb "$SS_MEMORY_BUDGET_GB" --run-dir "$SS_RUN_DIR" &
  SS_HOLDER_PID[$node]=$!
}

ss_start_holders() {
  local n
  for n in "${SS_ACTIVE[@]}" "${SS_SPARE_NODES[@]}"; do ss_start_holder "$n"; done
  [ "$SS_DRY_RUN" = 1 ] && return 0
  for n in "${SS_ACTIVE[@]}" "${SS_SPARE_NODES[@]}"; do
    ss_wait_for "holder on $n" "grep -q 'holder ready' '$SS_RUN_DIR/logs/holder_$n.log' 2>/dev/null" ||
      ss_die "the holder on $n did not start; see $SS_RUN_DIR/logs/holder_$n.log"
  done
}

# ---- 4. agents (torchrun per node) ----------------------------------------------------------------------
ss_start_agent() {
  local node=$1; shift
  # shellcheck disable=SC2086
  ss_run srun --overlap --no-kill -N1 -n1 -w "$node" --kill-on-bad-exit=0 --job-name="ss-agent-$node" \
    --output="$SS_RUN_DIR/logs/agent_$node.log" --open-mode=append $SS_SRUN_ARGS \
    "$SS_PYTHON" -m shardsafe.launch agent --node "$node" --control "$SS_CONTROL" \
    --nnodes "$SS_RUN_NODES:$SS_RUN_NODES" --nproc-per-node "$SS_NPROC_PER_NODE" --job-id "$SS_JOB_ID" \
    --rdzv-id "$SS_JOB_ID$([ "$SS_GEN" -gt 0 ] && echo ".g$SS_GEN")" --full-world-size "$SS_FULL_WORLD" \
    --run-dir "$SS_RUN_DIR" ${SS_HOLDER_DIR:+--holder-dir "$SS_HOLDER_DIR"} --max-restarts "$SS_MAX_RESTARTS" \
    --local-addr "$(ss_node_addr "$node")" --keep-alive-s "$SS_KEEP_ALIVE_S" --keep-alive-misses "$SS_KEEP_ALIVE_MISSES" \
    --join-timeout-s "$SS_JOIN_TIMEOUT" --job-start-t "$SS_T0" --inject "$SS_INJECT" \
    --torchrun-args "$SS_TORCHRUN_ARGS" --preload "$SS_PRELOAD" -- "$@" &
  SS_AGENT_PID[$node]=$!
  ss_log "agent on $node started (srun pid ${SS_AGENT_PID[$node]})"
}

# ---- 5. watch -------------------------------------------------------------------------------------------
ss_markers() { find "$SS_RUN_DIR/markers" -name 'rank*.done' 2>/dev/null | wc -l; }

ss_alive() { kill -0 "$1" 2>/dev/null; }

ss_node_lost() {  # NODE: report it, take a spare
  local node=$1; shift
  SS_LOST[$node]=1
  ss_log "node $node left the allocation (scontrol show job): reporting it, taking a spare"
  "$SS_PYTHON" -m shardsafe.launch control notify node-lost --run-dir "$SS_RUN_DIR" --node "$node" >/dev/null
  local keep=() n
  for n in "${SS_ACTIVE[@]}"; do [ "$n" != "$node" ] && keep+=("$n"); done
  SS_ACTIVE=("${keep[@]}")
  local live=" $(ss_live_nodes | tr '\n' ' ') "
  while [ "${#SS_SPARE_NODES[@]}" -gt 0 ]; do
    n=${SS_SPARE_NODES[0]}; SS_SPARE_NODES=("${SS_SPARE_NODES[@]:1}")
    if [[ $live == *" $n "* ]]; then
      SS_ACTIVE+=("$n")
      ss_start_agent "$n" "$@"
      return 0
    fi
  done
  if [ "$SS_SHRINK_AFTER_S" = 0 ]; then
    ss_log "no spare node left and shrinking is off (SS_SHRINK_AFTER_S=0): torch elastic cannot form a round of $SS_RUN_NODES nodes"
    return 1
  fi
  # A node that left a SLURM allocation does not come back to it, so a layout that cannot shrink fails now
  # rather than after the wait; the wait itself is the policy's, as in `shardsafe launch`.
  ss_shrink_plan "$@" >/dev/null || return 1
  [ -n "$SS_SHRINK_AT" ] || SS_SHRINK_AT=$(( $(date +%s) + ${SS_SHRINK_AFTER_S%.*} ))
  ss_log "no spare node left: continuing on the nodes left after SS_SHRINK_AFTER_S=${SS_SHRINK_AFTER_S}s"
  return 0
}

# `DP NODES` of the size the job continues at on the active nodes left (shardsafe control shrink-plan); its
# reason goes to logs/shrink.log, and is said when there is no such size (return 1).
ss_shrink_plan() {
  # shellcheck disable=SC2086
  "$SS_PYTHON" -m shardsafe.launch control shrink-plan --nnodes "$SS_NODES" --nproc-per-node "$SS_NPROC_PER_NODE" \
    --nodes-left "${#SS_ACTIVE[@]}" --from-dp "$SS_DP" --model-parallel "$SS_MODEL_PARALLEL" \
    --global-batch "$SS_GLOBAL_BATCH" --micro-batch "$SS_MICRO_BATCH" -- "$@" 2>>"$SS_RUN_DIR/logs/shrink.log" && return 0
  ss_log "cannot continue on ${#SS_ACTIVE[@]} node(s): $(tail -1 "$SS_RUN_DIR/logs/shrink.log")"
  return 1
}

# No spare, SS_SHRINK_AFTER_S passed: re-form the job on the active nodes left at the largest data-parallel
# size that keeps the global batch and runs on all of them (a node that runs no rank cannot serve its holder's
# memory to the restore). Its agents stop (their workers with them); new agents start on those nodes, in a
# rendezvous of that many nodes (a new rendezvous id: the old one still lists the agents that stopped). 1 when no
# smaller size works.
ss_shrink() {
  local plan dp k n node pid
  SS_SHRINK_AT=""
  plan=$(ss_shrink_plan "$@") || return 1
  read -r dp k <<< "$plan"
  ss_log "$(tail -1 "$SS_RUN_DIR/logs/shrink.log"); stopping the agents of ${SS_ACTIVE[*]}"
  for node in "${SS_ACTIVE[@]}"; do
    pid=${SS_AGENT_PID[$node]:-}
    [ -n "$pid" ] && ss_alive "$pid" && kill -TERM "$pid" 2>/dev/null
  done
  for node in "${SS_ACTIVE[@]}"; do
    pid=${SS_AGENT_PID[$node]:-}
    [ -n "$pid" ] && wait "$pid" 2>/dev/null
    unset "SS_AGENT_PID[$node]"
  done
  SS_SPARE_NODES+=("${SS_ACTIVE[@]:k}")
  SS_ACTIVE=("${SS_ACTIVE[@]:0:k}")
  SS_GEN=$(( SS_GEN + 1 )); SS_RUN_NODES=$k; SS_WORLD=$(( k * SS_NPROC_PER_NODE ))
  "$SS_PYTHON" -m shardsafe.launch control notify resize --run-dir "$SS_RUN_DIR" --from-dp "$SS_DP" --to-dp "$dp" \
    --world-size "$SS_WORLD" --node "$(IFS=,; echo "${SS_ACTIVE[*]}")" --reason "$(tail -1 "$SS_RUN_DIR/logs/shrink.log")" >/dev/null
  SS_DP=$dp
  for n in "${SS_ACTIVE[@]}"; do ss_start_agent "$n" "$@"; done
}

# Returns 0 when every rank finished, 1 on failure.
ss_watch() {
  local node rc live
  declare -A exited_at=()
  while :; do
    sleep "$SS_POLL_S"
    if [ "$(ss_markers)" -ge "$SS_WORLD" ]; then
      ss_log "every rank finished ($SS_WORLD markers)"
      return 0
    fi
    live=" $(ss_live_nodes | tr '\n' ' ') "
    for node in "${SS_ACTIVE[@]}"; do
      if [[ $live != *" $node "* ]]; then
        ss_node_lost "$node" "$@" || return 1
      fi
    done
    if [ -n "$SS_SHRINK_AT" ] && [ "$(date +%s)" -ge "$SS_SHRINK_AT" ]; then
      ss_shrink "$@" || return 1
      exited_at=()
      continue
    fi
    local running=0
    for node in "${SS_ACTIVE[@]}"; do
      if ss_alive "${SS_AGENT_PID[$node]}"; then running=$((running + 1)); continue; fi
      # An agent's srun ended. Give a node loss time to show in scontrol before calling it a failure
      # (SLURM kills the lost node's steps and shrinks the job at nearly the same moment).
      : "${exited_at[$node]:=$(date +%s)}"
      if [ $(( $(date +%s) - ${exited_at[$node]} )) -ge $(( 3 * SS_POLL_S + 2 )) ]; then
        wait "${SS_AGENT_PID[$node]}"; rc=$?
        if [ "$rc" != 0 ]; then
          ss_log "the agent on $node ended with rc=$rc (torch elastic gave up, see logs/agent_$node.log)"
          return 1
        fi
      else
        running=$((running + 1))
      fi
    done
    if [ "$running" = 0 ]; then
      # every agent ended with rc 0: only the markers prove every rank finished (a rank on a crashed
      # node never reports an exit code)
      sleep 1
      [ "$(ss_markers)" -ge "$SS_WORLD" ] && return 0
      ss_log "every agent ended but only $(ss_markers) of $SS_WORLD ranks left a completion marker"
      return 1
    fi
  done
}

# ---- 6. end ---------------------------------------------------------------------------------------------
# Holders stop gracefully: SIGTERM to their *tasks* (scancel --signal on the holder steps), so each writes
# the flushes still queued (at most 120 s, FLUSH_DRAIN_S) and frees its memory. SIGTERM to a holder's srun
# would SIGKILL it after KillWait instead (docs/slurm.md), losing the newest flush. Whatever is still
# running after SS_HOLDER_STOP_TIMEOUT is ended through its srun.
ss_stop_holders() {
  local node pid i left steps
  [ "$SS_DRY_RUN" = 1 ] && return 0
  steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk '$2 ~ /^ss-holder-/ {print $1}')
  # shellcheck disable=SC2086
  [ -n "$steps" ] && scancel --signal=TERM $steps 2>/dev/null
  for ((i = 0; i < SS_HOLDER_STOP_TIMEOUT * 10; i++)); do
    left=0
    for pid in "${SS_HOLDER_PID[@]}"; do ss_alive "$pid" && left=1; done
    [ $left = 0 ] && return 0; sleep 0.1
  done
  for node in "${!SS_HOLDER_PID[@]}"; do
    pid=${SS_HOLDER_PID[$node]}
    ss_alive "$pid" && ss_log "holder on $node still running ${SS_HOLDER_STOP_TIMEOUT}s after SIGTERM: ending its step" &&
      kill -TERM "$pid" 2>/dev/null
  done
}

ss_stop() {  # OK(0|1): agents, then holders, then the controller (its job_end closes T_obs)
  local ok=$1 node pid i
  if [ "$ok" = 1 ]; then   # agents leave torch elastic's exit barrier and close the rendezvous themselves
    for ((i = 0; i < SS_READY_TIMEOUT * 10; i++)); do
      local left=0
      for node in "${SS_ACTIVE[@]}"; do ss_alive "${SS_AGENT_PID[$node]}" && left=1; done
      [ $left = 0 ] && break; sleep 0.1
    done
  fi
  for node in "${!SS_AGENT_PID[@]}"; do pid=${SS_AGENT_PID[$node]}; ss_alive "$pid" && kill -TERM "$pid" 2>/dev/null; done
  ss_stop_holders
  for pid in "${SS_AGENT_PID[@]}" "${SS_HOLDER_PID[@]}"; do wait "$pid" 2>/dev/null; done
  "$SS_PYTHON" -m shardsafe.launch control notify job-end --run-dir "$SS_RUN_DIR" $([ "$ok" = 1 ] && echo --ok) >/dev/null
  if [ -n "${SS_CONTROLLER_PID:-}" ]; then
    for ((i = 0; i < 300; i++)); do ss_alive "$SS_CONTROLLER_PID" || break; sleep 0.1; done
    ss_alive "$SS_CONTROLLER_PID" && kill -TERM "$SS_CONTROLLER_PID" 2>/dev/null
    wait "$SS_CONTROLLER_PID" 2>/dev/null
  fi
}

ss_on_signal() {
  ss_log "batch script terminated (scancel, time limit or node failure): stopping"
  trap - TERM INT
  ss_stop 0
  exit 143
}

# The whole job: ss_main SCRIPT [ARGS...]
ss_main() {
  ss_setup
  trap ss_on_signal TERM INT
  ss_start_controller
  ss_start_holders
  local n
  for n in "${SS_ACTIVE[@]}"; do ss_start_agent "$n" "$@"; done
  [ "$SS_DRY_RUN" = 1 ] && { wait; return 0; }
  local ok=0
  ss_watch "$@" && ok=1
  ss_stop "$ok"
  ss_log "job $( [ $ok = 1 ] && echo finished || echo FAILED ); TOR: $SS_PYTHON -m shardsafe.tor report $SS_RUN_DIR"
  "$SS_PYTHON" -m shardsafe.tor report "$SS_RUN_DIR" > "$SS_RUN_DIR/tor_report.txt" 2>&1 || true
  if [ $ok = 1 ]; then return 0; fi
  if [ "$SS_REQUEUE_ON_FAILURE" = 1 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$SS_MAX_REQUEUES" ]; then
    ss_log "requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0} of $SS_MAX_REQUEUES)"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return 1
}
