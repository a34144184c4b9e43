# Helpers the two batch scripts (ps.sbatch, ddp.sbatch) source: checks of the Slurm environment and
# of the runner flags, the node of each task, a port per job. Sourced, never run: it defines
# functions and sets nothing. Every check prints one line naming the variable or flag and exits 2.

# slurm_require SCRIPT VAR...: stop unless every VAR is set (the script runs inside a Slurm job).
slurm_require() {
    local script=$1 var
    shift
    for var in "$@"; do
        if [[ -z "${!var:-}" ]]; then
            echo "$script: $var is not set: this script runs inside a Slurm job (submit it with sbatch)" >&2
            exit 2
        fi
    done
}

# slurm_refuse_flags SCRIPT "FLAG=why;FLAG=why" ARGS...: stop if ARGS holds a flag the script sets itself.
slurm_refuse_flags() {
    local script=$1 table=$2 arg entry flag
    shift 2
    local IFS=';'
    for entry in $table; do
        flag=${entry%%=*}
        for arg in "$@"; do
            if [[ "$arg" == "$flag" || "$arg" == "$flag="* ]]; then
                echo "$script: $flag is set by this script (${entry#*=})" >&2
                exit 2
            fi
        done
    done
}

# slurm_flag_value FLAG DEFAULT ARGS...: the value of the last FLAG V / FLAG=V in ARGS, else DEFAULT.
slurm_flag_value() {
    local flag=$1 value=$2 previous=""
    shift 2
    for arg in "$@"; do
        if [[ "$previous" == "$flag" ]]; then
            value=$arg
        elif [[ "$arg" == "$flag="* ]]; then
            value=${arg#*=}
        fi
        previous=$arg
    done
    echo "$value"
}

# slurm_without_flag FLAG ARGS...: ARGS less FLAG and its value (FLAG V or FLAG=V), NUL-separated.
slurm_without_flag() {
    local flag=$1 skip=0 arg
    shift
    for arg in "$@"; do
        if (( skip )); then
            skip=0
        elif [[ "$arg" == "$flag" ]]; then
            skip=1
        elif [[ "$arg" != "$flag="* ]]; then
            printf '%s\0' "$arg"
        fi
    done
}

# slurm_task_nodes: the node of each task of the job, one line per task in task order (Slurm's block
# layout: SLURM_TASKS_PER_NODE "2(x3),1" = 2 tasks on each of the first 3 nodes, 1 on the 4th).
slurm_task_nodes() {
    local nodes part count repeat node=0 r c
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    local IFS=','
    for part in $SLURM_TASKS_PER_NODE; do
        if [[ "$part" =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            count=${BASH_REMATCH[1]} repeat=${BASH_REMATCH[2]}
        else
            count=$part repeat=1
        fi
        for (( r = 0; r < repeat; r++, node++ )); do
            for (( c = 0; c < count; c++ )); do
                echo "${nodes[node]}"
            done
        done
    done
}

# slurm_job_port BASE: a port for this job, BASE + job id mod 10000 (jobs sharing a node differ).
slurm_job_port() {
    echo $(( $1 + SLURM_JOB_ID % 10000 ))
}
