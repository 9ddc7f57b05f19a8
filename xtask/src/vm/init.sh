#!/bin/busybox sh
# shellcheck shell=dash
# /init of the `cargo xtask vm` initramfs (busybox sh, runs as root, PID 1).
# Mounts what the kernel tests use, loads the modules listed in /etc/vm-modules (dependencies
# first), runs every /tests/* binary with --test-threads=1 (killed after the seconds in
# /etc/vm-binary-timeout) in two lanes, prints one line
#   PROXY-VM-RESULT: pass N fail M skip K
# and powers off. A test that prints "SKIP <test>: <reason>" (tests/src/features.rs) counts as a
# skip, not a pass; a binary that dies without a "test result:" line counts as one failure.

/bin/busybox mkdir -p /usr/bin /usr/sbin /sbin
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp PROXY_BIN=/bin/proxy
export RUST_BACKTRACE=1
# Load tests scale down under emulation: the VM checks what the kernel does, not throughput
# (kernel_proxy makes 100,000 connections by default: about 12 s natively, over 25 minutes
# under TCG).
export PROXY_TEST_CONNECTIONS=3000
# Proxy-pair splicing transfers (kernel_proxy_splice: 64 MiB per direction natively).
export PROXY_TEST_TRANSFER_MIB=8

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /sys/fs/cgroup /sys/fs/bpf /run/netns /tmp/claimed /tmp/results
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
ip link set lo up

echo "PROXY-VM: kernel $(uname -r), $(nproc) CPUs"
while read -r m; do
    insmod "/lib/modules/$m.ko" || echo "PROXY-VM: insmod $m failed"
done < /etc/vm-modules

filter=$(cat /etc/vm-filter)
limit=$(cat /etc/vm-binary-timeout)

# Runs one test binary, keeping its output in /tmp/results/<name>.out and its exit status in
# <name>.rc, and prints both when it ends. The tests make their own namespaces, cgroups and pin
# directories, as on the host, where other binaries run beside them.
run_binary() {
    name=${1##*/}
    start=$(date +%s)
    # shellcheck disable=SC2086 # an empty filter must vanish
    timeout "$limit" "$1" --test-threads=1 --nocapture $filter > "/tmp/results/$name.out" 2>&1
    rc=$?
    echo "$rc" > "/tmp/results/$name.rc"
    # One lane prints at a time, so two binaries' lines never interleave.
    while ! mkdir /tmp/printing 2> /dev/null; do sleep 1; done
    echo "PROXY-VM-BINARY: $name (limit ${limit} s)"
    cat "/tmp/results/$name.out"
    echo
    echo "PROXY-VM-BINARY-END: $name status $rc after $(($(date +%s) - start)) s"
    if [ "$rc" = 143 ]; then
        echo "PROXY-VM: $name killed after ${limit} s: the test running then hung or is too slow"
    fi
    rmdir /tmp/printing
}

# A lane takes the next binary no other lane has claimed (mkdir is atomic). The slowest under
# emulation go first, so that the two lanes end at about the same time.
lane() {
    for t in /tests/kernel_publish-* /tests/kernel_restart-* /tests/kernel_splice-* /tests/*; do
        [ -x "$t" ] || continue
        mkdir "/tmp/claimed/${t##*/}" 2> /dev/null || continue
        run_binary "$t"
    done
}

lane &
lane
wait

pass=0 fail=0 skip=0
for out in /tmp/results/*.out; do
    name=${out##*/}
    name=${name%.out}
    rc=$(cat "/tmp/results/$name.rc")
    # shellcheck disable=SC2046 # the counts are meant to split
    set -- $(awk '
        /^test result:/ { for (i = 2; i <= NF; i++) {
            if ($i == "passed;") p += $(i - 1)
            if ($i == "failed;") f += $(i - 1)
            if ($i == "ignored;") g += $(i - 1) } r = 1 }
        /SKIP [^ ]+: / { s++ }
        END { print p + 0, f + 0, g + s, s + 0, r + 0 }' "$out")
    pass=$((pass + $1 - $4)) fail=$((fail + $2)) skip=$((skip + $3))
    if [ "$rc" != 0 ] && [ "$2" = 0 ] || [ "$5" = 0 ]; then
        echo "PROXY-VM: $name exited with status $rc and no failed test: counted as one failure"
        fail=$((fail + 1))
    fi
done

left=$(find /sys/fs/bpf -mindepth 1 -maxdepth 1 | tr '\n' ' ')
[ -z "$left" ] || echo "PROXY-VM: left in /sys/fs/bpf after the tests: $left"
echo "PROXY-VM-RESULT: pass $pass fail $fail skip $skip"
sync
poweroff -f
