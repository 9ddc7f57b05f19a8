#!/bin/sh
# shellcheck shell=dash
# The check of `cargo xtask vm --systemd`, run by proxy-vm-check.service in apps.slice (the
# cgroup the daemon serves) once proxy.service has started. Drives the shipped units with
# systemctl, prints one `PROXY-VM-CHECK ok|FAILED: ...` line per check and at the end
#   PROXY-VM-RESULT: pass N fail M skip 0
# after which the unit's SuccessAction= powers the VM off. Every wait is bounded.

UNIT=proxy.service
CONFIG=/etc/proxy/proxy.yaml
PINS=/sys/fs/bpf/vm
DIRECT=127.77.0.1:80 # web-direct: the kernel path
PROXIED=127.77.0.2:80 # web-proxy: mode proxy
BODY=proxy-vm-backend
pass=0 fail=0

ok() {
    echo "PROXY-VM-CHECK ok: $*"
    pass=$((pass + 1))
}
bad() {
    echo "PROXY-VM-CHECK FAILED: $*"
    fail=$((fail + 1))
}
# check DESCRIPTION COMMAND...: one check, passed when COMMAND succeeds.
check() {
    what=$1
    shift
    if "$@"; then ok "$what"; else bad "$what"; fi
}
# expect DESCRIPTION WANTED ACTUAL
expect() {
    if [ "$2" = "$3" ]; then ok "$1 ($3)"; else bad "$1: expected '$2', got '$3'"; fi
}
prop() { systemctl show -p "$1" --value "${2:-$UNIT}"; }
# served ADDR: an HTTP GET to ADDR (from this cgroup) reaches the backend.
# (busybox 1.35's `wget -T` crashes on a refused connect, hence timeout(1) around it.)
get() { timeout -s KILL 10 wget -q -O - "http://$1" 2> /dev/null; }
served() { [ "$(get "$1/")" = "$BODY" ]; }
refused() { ! get "$1/" > /dev/null; }
admin() { get "127.0.0.1:15000$1"; }
counter() { admin /stats | sed -n "s/^$1: //p"; }
journal_has() { journalctl -q --no-pager -u "$1" | grep -q "$2"; }
# now: seconds since boot, as the journal's monotonic stamps count them.
now() { cut -d' ' -f1 /proc/uptime; }
# timed WHAT COMMAND...: runs COMMAND and notes when it began and ended.
timed() {
    label=$1
    shift
    began=$(now)
    "$@"
    echo "PROXY-VM: $label from $began s to $(now) s"
}
# wait_for SECONDS COMMAND...: polls COMMAND every 0.2 s until it succeeds or time is up.
wait_for() {
    tries=$(($1 * 5))
    shift
    while [ "$tries" -gt 0 ]; do
        "$@" && return 0
        tries=$((tries - 1))
        sleep 0.2
    done
    return 1
}
# A connect loop to both services, in the background, until /run/loop.stop exists (at most
# 3000 rounds): counts rounds and failed requests in /run/loop.rounds and /run/loop.failed, and
# notes each failure (which path, and when) in /run/loop.log.
loop_start() {
    rm -f /run/loop.stop /run/loop.done /run/loop.log
    (
        rounds=0 failed=0
        while [ ! -e /run/loop.stop ] && [ "$rounds" -lt 3000 ]; do
            for addr in "$PROXIED" "$DIRECT"; do
                if ! served "$addr"; then
                    failed=$((failed + 1))
                    echo "round $rounds: $addr failed at $(now) s" >> /run/loop.log
                fi
            done
            rounds=$((rounds + 1))
        done
        echo "$rounds" > /run/loop.rounds
        echo "$failed" > /run/loop.failed
        touch /run/loop.done
    ) &
}
loop_stop() {
    touch /run/loop.stop
    wait_for 20 test -e /run/loop.done
    sed 's/^/PROXY-VM: connect loop: /' /run/loop.log 2> /dev/null >&2
    echo "$(cat /run/loop.rounds 2> /dev/null || echo 0) rounds, $(cat /run/loop.failed 2> /dev/null || echo '?') failed"
}
# under_loop DESCRIPTION COMMAND...: runs COMMAND 2 s into a connect loop that goes on 2 s
# after it; one check, passed when the loop made rounds and no request failed.
under_loop() {
    description=$1
    shift
    loop_start
    sleep 2
    timed "$*" "$@"
    sleep 2
    summary=$(loop_stop)
    check "$description under a connect loop to both services: $summary" \
        test "$(cat /run/loop.failed 2> /dev/null)" = 0 -a "$(cat /run/loop.rounds 2> /dev/null || echo 0)" -gt 0
}

echo "PROXY-VM: $(systemctl --version | head -1), kernel $(uname -r)"
echo "PROXY-VM: $(ip -o addr show dev lo | tr -s ' ' | cut -d' ' -f2-4 | tr '\n' ' ')"
version=$(systemctl --version | sed -n '1s/^systemd \([0-9]*\).*/\1/p')
wait_for 10 served 127.0.0.1:8080 || bad "the backend (busybox httpd) did not answer on 127.0.0.1:8080"

# 1. The boot's start (this unit is ordered after proxy.service).
expect "proxy.service active after the boot's start" active "$(prop ActiveState)"
expect "Type" notify "$(prop Type)"
expect "NotifyAccess" main "$(prop NotifyAccess)"
expect "StatusText is the daemon's STATUS line" "serving 2 services" "$(prop StatusText)"
expect "WatchdogUSec as shipped" 30s "$(prop WatchdogUSec)"
uid=$(sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$(prop MainPID)/status")
expect "the daemon runs as ebpf-proxy" "$(id -u ebpf-proxy)" "$uid"
check "the kernel path serves $DIRECT" served "$DIRECT"
before=$(counter proxy.downstream_cx_total)
check "the proxy path serves $PROXIED" served "$PROXIED"
after=$(counter proxy.downstream_cx_total)
check "the daemon's proxy relayed it (proxy.downstream_cx_total $before -> $after)" \
    test "${after:-0}" -gt "${before:-0}"

# 2. `systemctl start` returns after READY=1: from an instance with nothing in the kernel (stop,
# uninstall), the services serve the moment the start returns.
systemctl stop "$UNIT"
proxy uninstall --config "$CONFIG" 2>&1 | sed 's/^/PROXY-VM: uninstall: /'
check "after stop and uninstall the kernel path is gone ($DIRECT refused)" refused "$DIRECT"
systemctl start "$UNIT"
expect "ActiveState right after systemctl start" active "$(prop ActiveState)"
check "/ready answers right after systemctl start" test "$(admin /ready)" != ""
check "the kernel path serves right after systemctl start" served "$DIRECT"
check "the proxy path serves right after systemctl start" served "$PROXIED"
expect "StatusText right after systemctl start" "serving 2 services" "$(prop StatusText)"
started=$(date +%s)
pid=$(prop MainPID)

# 3. The watchdog, as shipped (30 s): fed, so 40 s later the same daemon runs.
sleep $((started + 40 - $(date +%s)))
expect "40 s later, the same main PID" "$pid" "$(prop MainPID)"
expect "40 s later, restarts" 0 "$(prop NRestarts)"
no_timeout() { ! journal_has "$UNIT" "atchdog timeout"; }
check "40 s later, no watchdog timeout in the journal" no_timeout

# 4. The watchdog is real: with WatchdogSec=10s the daemon pings often enough, and once wedged
# (SIGSTOP) systemd kills it and Restart=on-failure starts another.
mkdir -p /run/systemd/system/$UNIT.d
printf '[Service]\nWatchdogSec=10s\n' > /run/systemd/system/$UNIT.d/watchdog.conf
systemctl daemon-reload
systemctl restart "$UNIT"
expect "WatchdogUSec with the drop-in" 10s "$(prop WatchdogUSec)"
expect "systemctl restart with the drop-in" active "$(prop ActiveState)"
pid=$(prop MainPID)
sleep 25
expect "25 s at WatchdogSec=10s, the same main PID" "$pid" "$(prop MainPID)"
kill -STOP "$pid"
restarted() { [ "$(prop MainPID)" != "$pid" ] && [ "$(prop ActiveState)" = active ]; }
check "a wedged daemon (SIGSTOP) is killed by the watchdog and restarted within 40 s" \
    wait_for 40 restarted
check "the journal names the watchdog timeout" journal_has "$UNIT" "atchdog timeout"
expect "restarts" 1 "$(prop NRestarts)"
check "the restarted daemon serves the kernel path" served "$DIRECT"
check "the restarted daemon serves the proxy path" served "$PROXIED"
rm -r /run/systemd/system/$UNIT.d
systemctl daemon-reload
systemctl restart "$UNIT"
expect "WatchdogUSec back as shipped" 30s "$(prop WatchdogUSec)"
expect "systemctl restart without the drop-in" active "$(prop ActiveState)"

# 5. `systemctl restart` under a connect loop to both services.
pid=$(prop MainPID)
fdstore=$(tr '\0' '\n' < "/proc/$pid/environ" | sed -n 's/^FDSTORE=//p')
echo "PROXY-VM: systemd $version: \$FDSTORE='$fdstore', NFileDescriptorStore=$(prop NFileDescriptorStore)"
if [ "$version" -ge 254 ]; then
    check "systemd $version offers the store (\$FDSTORE)" test -n "$fdstore"
    check "the listener is in the unit's store" test "$(prop NFileDescriptorStore)" -gt 0
else
    # systemd before 254 sets no $FDSTORE: the daemon stores nothing, and during the restart
    # the kernel connects the proxy-mode TCP service straight to its hosts.
    expect "systemd $version sets no \$FDSTORE" "" "$fdstore"
    expect "nothing in the unit's store" 0 "$(prop NFileDescriptorStore)"
fi
absent=$(counter bpf.connect_proxy_absent_direct)
under_loop "systemctl restart" systemctl restart "$UNIT"
echo "PROXY-VM: bpf.connect_proxy_absent_direct $absent -> $(counter bpf.connect_proxy_absent_direct)"
check "the new daemon is another process" test "$(prop MainPID)" != "$pid"

# 5b. Before 254, what systemd does with the store once the daemon is told of it: a drop-in
# sets $FDSTORE as 254 and later do. The next daemon stores its listener, and a restart under
# the connect loop hands it back (LISTEN_FDS).
if [ "$version" -lt 254 ]; then
    mkdir -p /run/systemd/system/$UNIT.d
    printf '[Service]\nEnvironment=FDSTORE=256\n' > /run/systemd/system/$UNIT.d/fdstore.conf
    systemctl daemon-reload
    systemctl restart "$UNIT"
    stored() { [ "$(prop NFileDescriptorStore)" -gt 0 ]; }
    check "with \$FDSTORE from a drop-in, systemd $version holds the stored listener" \
        wait_for 10 stored
    under_loop "with \$FDSTORE from a drop-in, systemctl restart" systemctl restart "$UNIT"
    check "with \$FDSTORE from a drop-in, the restarted daemon took the listener back from the store" \
        journal_has "$UNIT" "passed the proxy listener's sockets back"
    rm -r /run/systemd/system/$UNIT.d
    systemctl daemon-reload
fi

# 6. proxy@.service: a takeover between two instances under a connect loop.
systemctl stop "$UNIT"
systemctl start proxy@blue.service
expect "proxy@blue active" active "$(prop ActiveState proxy@blue.service)"
check "proxy@blue serves the proxy path" served "$PROXIED"
loop_start
sleep 2
timed "systemctl start proxy@green.service" systemctl start proxy@green.service
expect "proxy@green active after the takeover" active "$(prop ActiveState proxy@green.service)"
blue_gone() { [ "$(prop ActiveState proxy@blue.service)" = inactive ]; }
check "proxy@blue drained and ended within 20 s" wait_for 20 blue_gone
expect "proxy@blue's result" success "$(prop Result proxy@blue.service)"
summary=$(loop_stop)
check "the takeover under a connect loop to both services: $summary" \
    test "$(cat /run/loop.failed 2> /dev/null)" = 0 -a "$(cat /run/loop.rounds 2> /dev/null || echo 0)" -gt 0
systemctl stop proxy@green.service

# 7. A stop leaves the data path pinned and serving; `proxy uninstall` removes it.
systemctl start "$UNIT"
systemctl stop "$UNIT"
expect "ActiveState after systemctl stop" inactive "$(prop ActiveState)"
check "the pins stay after the stop ($PINS)" test -d "$PINS"
check "the kernel path serves after the stop" served "$DIRECT"
check "the proxy-mode TCP service is served after the stop (kernel, straight to the host)" served "$PROXIED"
check "proxy uninstall after the stop" proxy uninstall --config "$CONFIG"
check "the pins are gone after uninstall" test ! -e "$PINS"
check "the kernel path is gone after uninstall ($DIRECT refused)" refused "$DIRECT"

if [ "$fail" != 0 ]; then
    echo "PROXY-VM: the journal of the daemon's units:"
    journalctl -q --no-pager -o short-monotonic -u proxy.service -u 'proxy@*' | tail -n 150
fi
echo "PROXY-VM-RESULT: pass $pass fail $fail skip 0"
