// The interpreter's version as cfgs (`Py_3_12`, ...), for `small_int`.
fn main() {
    pyo3_build_config::use_pyo3_cfgs();
}
