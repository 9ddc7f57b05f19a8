//! The feature probes of `integration_tests::features` against the running kernel (root): a
//! feature that mainline has had since a release at or below this kernel's must probe as
//! present, so a kernel test never skips on a kernel that has what it needs. Prints what the
//! kernel offers (the table of docs/kernel-support.md is filled from these lines in the VM).

use integration_tests::{
    features::{self, Feature},
    kernel::require_root,
};

#[test]
fn probes_agree_with_the_kernel_version() {
    require_root();
    let (major, minor, _) = features::kernel_version();
    let release = features::kernel_release();
    let mut wrong = Vec::new();
    for feature in Feature::ALL {
        let missing = features::missing(&[feature]);
        let min = feature.min_kernel();
        eprintln!(
            "FEATURE {release} {feature:?}: {}",
            missing
                .as_deref()
                .map_or("present".to_owned(), |why| format!("missing: {why}"))
        );
        if let (Some(why), Some(min)) = (&missing, min)
            && (major, minor) >= min
        {
            wrong.push(format!(
                "{feature:?} (mainline {}.{}+): {why}",
                min.0, min.1
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "probes report features missing on {release}: {wrong:#?}"
    );
}

#[test]
fn skip_unless_is_silent_when_every_feature_is_there() {
    require_root();
    let basics = [
        Feature::ConnectHooks,
        Feature::GetpeernameHooks,
        Feature::CgroupLink,
    ];
    if features::missing(&basics).is_none() {
        assert!(!features::skip_unless("skip_unless_is_silent", &basics));
    }
}
