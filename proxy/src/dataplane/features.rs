//! What the running kernel offers beyond the programs' minimum (`abi::features`): probed once
//! when the programs are loaded, and what a service may ask for because of it (the hash keys
//! whose helpers only newer kernels have in cgroup sock_addr programs).

use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported},
};
use proxy_common::{
    abi,
    service::{HASH_KEY_CGROUP, HASH_KEY_PROCESS, SERVICE_F_MAGLEV, hash_key_of},
};
use tracing::{info, warn};

use super::DataplaneError;

/// What the kernel offers beyond the programs' minimum, as the bits of
/// `abi::features::GLOBAL`. A probe that fails counts as the feature missing: the programs then
/// keep the behaviour every supported kernel has.
pub(super) fn probe() -> u32 {
    let mut bits = 0;
    let probes = [
        (
            BpfHelper::BPF_FUNC_set_retval,
            abi::features::SET_RETVAL,
            "refused connects fail with EPERM: bpf_set_retval needs kernel 5.18",
        ),
        (
            BpfHelper::BPF_FUNC_get_current_pid_tgid,
            abi::features::CURRENT_PID_TGID,
            "hash_key process unavailable: this kernel has no bpf_get_current_pid_tgid in cgroup sock_addr programs (5.10 has it)",
        ),
        (
            BpfHelper::BPF_FUNC_get_current_cgroup_id,
            abi::features::CURRENT_CGROUP_ID,
            "hash_key cgroup unavailable: this kernel has no bpf_get_current_cgroup_id in cgroup sock_addr programs (5.7 has it)",
        ),
    ];
    for (helper, bit, missing) in probes {
        match is_helper_supported(ProgramType::CgroupSockAddr, helper) {
            Ok(true) => bits |= bit,
            Ok(false) => info!("{missing}"),
            Err(err) => {
                warn!(%err, ?helper, "probing a helper failed; taken as missing: {missing}");
            }
        }
    }
    bits
}

/// Whether the programs, on a kernel with `features`, can read the hash key of a service `name`
/// with `flags`: the process and cgroup keys need helpers the loader probes for; the others are
/// there on every supported kernel.
pub(super) fn check_hash_key(name: &str, flags: u32, features: u32) -> Result<(), DataplaneError> {
    if flags & SERVICE_F_MAGLEV == 0 {
        return Ok(());
    }
    let (key, feature, helper, kernel) = match hash_key_of(flags) {
        HASH_KEY_PROCESS => (
            "process",
            abi::features::CURRENT_PID_TGID,
            "bpf_get_current_pid_tgid",
            "5.10",
        ),
        HASH_KEY_CGROUP => (
            "cgroup",
            abi::features::CURRENT_CGROUP_ID,
            "bpf_get_current_cgroup_id",
            "5.7",
        ),
        _ => return Ok(()),
    };
    if features & feature != 0 {
        return Ok(());
    }
    Err(DataplaneError::NoHashKey {
        service: name.to_owned(),
        key,
        helper,
        kernel,
    })
}

#[cfg(test)]
mod tests {
    use proxy_common::service::{HASH_KEY_USER, SERVICE_HASH_KEY_SHIFT};

    use super::*;

    #[test]
    fn a_hash_key_is_refused_only_where_its_helper_is_missing() {
        let keyed = |key: u32| SERVICE_F_MAGLEV | (key << SERVICE_HASH_KEY_SHIFT);
        let process = keyed(HASH_KEY_PROCESS);
        let err = check_hash_key("web", process, abi::features::CURRENT_CGROUP_ID).unwrap_err();
        assert_eq!(
            err.to_string(),
            "service web: hash_key process needs bpf_get_current_pid_tgid in cgroup sock_addr \
             programs, which this kernel lacks (Linux 5.10 and later have it); choose hash_key \
             netns, user or socket"
        );
        assert!(check_hash_key("web", process, abi::features::CURRENT_PID_TGID).is_ok());
        let cgroup = keyed(HASH_KEY_CGROUP);
        assert!(check_hash_key("web", cgroup, abi::features::CURRENT_PID_TGID).is_err());
        assert!(check_hash_key("web", keyed(HASH_KEY_USER), 0).is_ok());
        // A service that does not hash reads no key, whatever its bits say.
        assert!(check_hash_key("web", HASH_KEY_PROCESS << SERVICE_HASH_KEY_SHIFT, 0).is_ok());
    }
}
