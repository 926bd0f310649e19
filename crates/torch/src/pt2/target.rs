//! The machine a package was compiled for against this one, from its metadata alone (before any
//! of its code is loaded): the platform and machine (`AOTI_PLATFORM`, `AOTI_MACHINE`, Python's
//! `sys.platform` and `platform.machine()` at the export), then the instruction sets its code
//! needs: the export helper's `stageload.target` (a `-march` level), else libtorch's
//! `AOTI_CPU_ISA` (Inductor's vector ISA, `AVX512 AVX512_VNNI`). A name this file does not know
//! is refused: it cannot say what the code needs.

use std::collections::HashMap;
use std::path::Path;

use super::Pt2Error;

/// Refuses a package compiled for another platform or machine, for instructions this CPU lacks,
/// or for a target this file cannot check.
pub(super) fn check(path: &Path, metadata: &HashMap<String, String>) -> Result<(), Pt2Error> {
    check_with(path, metadata, &Cpu::this())
}

/// [`check`] against `cpu`.
fn check_with(path: &Path, metadata: &HashMap<String, String>, cpu: &Cpu) -> Result<(), Pt2Error> {
    let platform = metadata.get("AOTI_PLATFORM").map(|p| os_of(p));
    let machine = metadata.get("AOTI_MACHINE").map(|m| arch_of(m));
    if platform.is_some_and(|p| p != cpu.os) || machine.is_some_and(|m| m != cpu.arch) {
        let recorded = format!("{} {}", platform.unwrap_or("?"), machine.unwrap_or("?"));
        return Err(Pt2Error::Machine { path: path.into(), recorded, this: cpu.describe() });
    }
    let unknown =
        |target: &str| Pt2Error::UnknownTarget { path: path.into(), target: target.into(), this: cpu.describe() };
    let (target, needs) = match (metadata.get("stageload.target"), metadata.get("AOTI_CPU_ISA")) {
        (Some(level), _) => (level.clone(), level_features(level).ok_or_else(|| unknown(level))?),
        (None, Some(isa)) => (format!("the vector ISA {isa}"), isa_features(isa).map_err(|_| unknown(isa))?),
        (None, None) => return Ok(()),
    };
    let lacking: Vec<&'static str> = needs.into_iter().filter(|f| !cpu.has(f)).collect();
    if !lacking.is_empty() {
        return Err(Pt2Error::Target { path: path.into(), target, lacking });
    }
    Ok(())
}

/// The OS a recorded `sys.platform` names, as Rust names it.
fn os_of(platform: &str) -> &str {
    match platform {
        "darwin" => "macos",
        "win32" => "windows",
        other => other.trim_end_matches(|c: char| c.is_ascii_digit()),
    }
}

/// The architecture a recorded `platform.machine()` names, as Rust names it.
fn arch_of(machine: &str) -> &str {
    match machine {
        "AMD64" | "amd64" | "x64" => "x86_64",
        "arm64" | "ARM64" => "aarch64",
        other => other,
    }
}

const V2: &[&str] = &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cmpxchg16b"];
const V3: &[&str] = &["avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt", "movbe"];
const V4: &[&str] = &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"];

/// The instruction sets an x86-64 `-march` level needs (`None`: not a level this knows).
fn level_features(level: &str) -> Option<Vec<&'static str>> {
    let levels: &[&[&str]] = match level {
        "x86-64" => &[],
        "x86-64-v2" => &[V2],
        "x86-64-v3" => &[V2, V3],
        "x86-64-v4" => &[V2, V3, V4],
        _ => return None,
    };
    Some(levels.concat())
}

/// The instruction sets each word of Inductor's vector ISA needs (the compile flags of its
/// `VecAVX2`, `VecAVX512`, `VecAVX512VNNI`, `VecAMX` in torch 2.13); `INVALID_VEC_ISA`
/// (scalar code) and the ISAs of other machines (`ASIMD`, `NEON`, `VSX`, `ZVECTOR`, whose
/// machine the check before this compared) need none. The first word this does not know is
/// the error.
pub(super) fn isa_features(isa: &str) -> Result<Vec<&'static str>, String> {
    let mut needs = Vec::new();
    for word in isa.split_whitespace() {
        needs.extend_from_slice(match word {
            "INVALID_VEC_ISA" | "ASIMD" | "NEON" | "VSX" | "ZVECTOR" => &[][..],
            "AVX2" => &["avx2", "fma", "f16c"],
            "AVX512" => &["avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"],
            "AVX512_VNNI" => &["avx512vnni"],
            "AMX_TILE" => &["amx_tile", "amx_bf16", "amx_int8"],
            other => return Err(other.to_string()),
        });
    }
    Ok(needs)
}

/// This machine: its OS, architecture, and which instruction sets its CPU has.
pub(super) struct Cpu {
    os: &'static str,
    arch: &'static str,
    has: fn(&str) -> bool,
}

impl Cpu {
    pub(super) fn this() -> Cpu {
        Cpu { os: std::env::consts::OS, arch: std::env::consts::ARCH, has: cpu_has }
    }

    fn has(&self, feature: &str) -> bool {
        (self.has)(feature)
    }

    /// `linux x86_64 (AVX512 AVX512_VNNI)`: the platform and the widest vector ISA Inductor
    /// would pick here.
    fn describe(&self) -> String {
        let widest = ["AVX512 AVX512_VNNI AMX_TILE", "AVX512 AVX512_VNNI", "AVX512", "AVX2"]
            .into_iter()
            .find(|isa| isa_features(isa).is_ok_and(|needs| needs.iter().all(|f| self.has(f))));
        match (self.arch, widest) {
            ("x86_64", Some(isa)) => format!("{} {} ({isa})", self.os, self.arch),
            _ => format!("{} {}", self.os, self.arch),
        }
    }
}

/// Whether this CPU has instruction set `feature` (x86-64 only; elsewhere none of these). AMX,
/// whose detection the standard library has not stabilised, from the kernel's CPU flags.
fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($name:tt),*) => {
                match feature {
                    $($name => std::arch::is_x86_feature_detected!($name),)*
                    "amx_tile" | "amx_bf16" | "amx_int8" => kernel_flags().iter().any(|f| f == feature),
                    _ => false,
                }
            };
        }
        detect!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "cmpxchg16b",
            "avx",
            "avx2",
            "bmi1",
            "bmi2",
            "f16c",
            "fma",
            "lzcnt",
            "movbe",
            "avx512f",
            "avx512bw",
            "avx512cd",
            "avx512dq",
            "avx512vl",
            "avx512vnni"
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

/// The `flags` of the first processor in `/proc/cpuinfo` (none where it cannot be read).
#[cfg(target_arch = "x86_64")]
fn kernel_flags() -> &'static [String] {
    static FLAGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    FLAGS.get_or_init(|| {
        let info = stageload_input::read_text(Path::new("/proc/cpuinfo"), 64 << 20).unwrap_or_default();
        let flags = info.lines().find_map(|l| l.strip_prefix("flags")).and_then(|l| l.split_once(':'));
        flags.map(|(_, f)| f.split_whitespace().map(str::to_string).collect()).unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// An x86-64 Linux CPU with AVX2 and nothing wider.
    fn avx2_cpu() -> Cpu {
        Cpu { os: "linux", arch: "x86_64", has: |f| V2.contains(&f) || V3.contains(&f) }
    }

    #[test]
    fn each_level_needs_the_ones_below_it_and_an_unknown_level_is_none() {
        let v3 = level_features("x86-64-v3").unwrap();
        assert!(v3.contains(&"sse4.2") && v3.contains(&"avx2") && !v3.contains(&"avx512f"));
        assert!(level_features("x86-64-v4").unwrap().contains(&"avx512f"));
        assert_eq!(level_features("native"), None, "native is no level: it names no instruction set");
    }

    #[test]
    fn inductors_vector_isas_map_to_their_instruction_sets_and_an_unknown_word_is_an_error() {
        assert_eq!(isa_features("AVX2").unwrap(), ["avx2", "fma", "f16c"]);
        let vnni = isa_features("AVX512 AVX512_VNNI").unwrap();
        assert!(vnni.contains(&"avx512bw") && vnni.contains(&"avx512vnni"), "{vnni:?}");
        assert!(isa_features("AVX512 AVX512_VNNI AMX_TILE").unwrap().contains(&"amx_tile"));
        assert!(isa_features("INVALID_VEC_ISA").unwrap().is_empty());
        assert_eq!(isa_features("SVE256"), Err("SVE256".to_string()));
        assert_eq!(isa_features("AVX512 AVX10"), Err("AVX10".to_string()));
    }

    #[test]
    fn a_package_for_another_machine_or_platform_is_refused_naming_both() {
        let cpu = avx2_cpu();
        let arm = metadata(&[("AOTI_PLATFORM", "linux"), ("AOTI_MACHINE", "aarch64"), ("AOTI_CPU_ISA", "SVE256")]);
        match check_with(Path::new("m.pt2"), &arm, &cpu) {
            Err(Pt2Error::Machine { recorded, this, .. }) => {
                assert_eq!((recorded.as_str(), this.as_str()), ("linux aarch64", "linux x86_64 (AVX2)"))
            }
            other => panic!("not a machine error: {other:?}"),
        }
        let mac = metadata(&[("AOTI_PLATFORM", "darwin"), ("AOTI_MACHINE", "x86_64")]);
        assert!(matches!(check_with(Path::new("m.pt2"), &mac, &cpu), Err(Pt2Error::Machine { .. })));
        let windows = metadata(&[("AOTI_PLATFORM", "linux"), ("AOTI_MACHINE", "AMD64"), ("AOTI_CPU_ISA", "AVX2")]);
        assert!(check_with(Path::new("m.pt2"), &windows, &cpu).is_ok(), "AMD64 is x86_64");
    }

    #[test]
    fn a_package_for_instructions_this_cpu_lacks_or_for_an_unknown_target_is_refused() {
        let cpu = avx2_cpu();
        let on = |isa: &str| metadata(&[("AOTI_PLATFORM", "linux"), ("AOTI_MACHINE", "x86_64"), ("AOTI_CPU_ISA", isa)]);
        assert!(check_with(Path::new("m.pt2"), &on("AVX2"), &cpu).is_ok());
        match check_with(Path::new("m.pt2"), &on("AVX512 AVX512_VNNI"), &cpu) {
            Err(Pt2Error::Target { target, lacking, .. }) => {
                assert_eq!(target, "the vector ISA AVX512 AVX512_VNNI");
                assert!(lacking.contains(&"avx512f") && lacking.contains(&"avx512vnni"), "{lacking:?}");
            }
            other => panic!("not a target error: {other:?}"),
        }
        let err = check_with(Path::new("m.pt2"), &on("AVX10"), &cpu).unwrap_err();
        assert!(matches!(&err, Pt2Error::UnknownTarget { target, .. } if target == "AVX10"), "{err}");
        assert!(err.to_string().contains("linux x86_64 (AVX2)"), "names this machine too: {err}");
        let level = metadata(&[("stageload.target", "x86-64-v4"), ("AOTI_CPU_ISA", "AVX2")]);
        assert!(matches!(check_with(Path::new("m.pt2"), &level, &cpu), Err(Pt2Error::Target { .. })), "the level wins");
        let native = metadata(&[("stageload.target", "native")]);
        assert!(matches!(check_with(Path::new("m.pt2"), &native, &cpu), Err(Pt2Error::UnknownTarget { .. })));
    }
}
