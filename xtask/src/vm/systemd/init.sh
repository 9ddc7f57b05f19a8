#!/bin/busybox sh
# shellcheck shell=dash
# /init of the `cargo xtask vm --systemd` initramfs (busybox sh, PID 1). Copies the image into a
# tmpfs and hands PID 1 to systemd there (switch_root), as a distribution's initramfs hands over
# to its real root: systemd's sandboxing of the units (ProtectSystem=, PrivateTmp=,
# PrivateDevices=) then works on an ordinary mount rather than the initial rootfs.

bb=/bin/busybox
$bb mount -t proc proc /proc
$bb mkdir -p /newroot
$bb mount -t tmpfs -o mode=0755 tmpfs /newroot
for d in bin etc lib lib64 srv usr var; do
    [ -e "/$d" ] && $bb cp -a "/$d" /newroot/
done
for d in dev proc sys run tmp root var/tmp; do
    $bb mkdir -p "/newroot/$d"
done
$bb chmod 1777 /newroot/tmp /newroot/var/tmp
$bb ln -s /run /newroot/var/run
$bb cp -a /dev/console /newroot/dev/
# The shell tools the check and backend units use (sh, wget, httpd, kill, ...), as links to
# busybox; not its init or power applets, which would talk to a busybox init.
$bb --install -s /newroot/bin
for applet in init halt poweroff reboot shutdown linuxrc; do
    $bb rm -f "/newroot/bin/$applet"
done
$bb umount /proc
echo "PROXY-VM: handing over to systemd"
exec $bb switch_root /newroot /lib/systemd/systemd
